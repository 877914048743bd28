"""One decoding step: from next-token logits to chosen tokens and their behaviour log-probs.

Given float32 logits ``z`` [B, V] for the next token, temperature ``T``, and a set of *blocked*
tokens (the stop tokens while fewer than ``min_new_tokens`` tokens have been generated), given as a
boolean mask over the vocabulary so that choosing never reads anything back to the host:

- **penalties** (:func:`apply_penalties`, when any is set): the choice reads ``z' = penalties(z)``
  instead of ``z``, greedy included; the reported log-prob still reads ``z``.
- **greedy**: ``token = argmax(z' with blocked ids at -inf)``; ``logprob = log_softmax(z)[token]``.
- **sampling**: ``s = z' / T``; blocked ids are set to ``-inf``; then top-k keeps the ``k`` largest
  entries of ``s`` (ties with the k-th value are kept too), then top-p keeps the smallest set of
  most likely tokens whose probability (renormalised after top-k) reaches ``p`` (the most likely
  token is always kept), then min-p keeps the tokens with ``q_j >= min_p * max_i q_i`` (``q``:
  the probabilities left after top-p; as a ratio to the most likely token, which every filter
  keeps, it is the same in ``softmax(s)``); ``token ~ softmax(filtered s)``;
  ``logprob = log_softmax(z / T)[token]``. (The order temperature -> top-k -> top-p -> min-p is
  transformers' and SGLang's; vLLM applies min-p before top-k/top-p, which differs only when
  top-p and min-p are both set.)

The reported log-prob is that of the model's temperature-scaled distribution *before* penalties,
blocking and top-k/top-p/min-p filtering: exactly what a train engine recomputes as
``log_softmax(logits / T)`` for the same tokens, so the first PPO ratio of on-policy data is 1.
(The filtered distribution differs from it only by the renormalisation over the kept tokens; a
penalised one by the penalties too: penalties, like the filters, are a sampling device whose
samples the trainer weighs as the policy's own.)
"""

from __future__ import annotations

import torch
from core_rl.interfaces import SamplingParams


def block_tokens(logits: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with the columns where ``blocked`` (bool [V]) is true set to
    ``-inf``; ``logits`` itself when ``blocked`` is ``None``."""
    if blocked is None:
        return logits
    return logits.masked_fill(blocked, float("-inf"))


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep, per row, entries ``>=`` the ``k``-th largest value; the rest become ``-inf``.

    ``k <= 0`` or ``k >= V`` returns ``logits`` unchanged.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: per row, sort tokens by probability ``q`` (descending) and keep token
    ``j`` of that order iff ``sum_{i<j} q_i < p``: the smallest prefix whose mass reaches ``p``.
    The rest become ``-inf``. ``p >= 1`` returns ``logits`` unchanged.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p filtering: per row, with ``q = softmax(logits)``, keep token ``j`` iff
    ``q_j >= min_p * max_i q_i``, i.e. ``logits_j >= max_i logits_i + log(min_p)``; the rest
    become ``-inf`` (the most likely token is always kept). ``min_p <= 0`` returns ``logits``
    unchanged."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def penalties_set(sampling: SamplingParams) -> bool:
    """Whether ``sampling`` asks for any repetition, frequency or presence penalty."""
    return sampling.repetition_penalty != 1.0 or sampling.frequency_penalty != 0.0 or sampling.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, sampling: SamplingParams
) -> torch.Tensor:
    """vLLM's penalties on ``logits`` [B, V] (a new tensor): for the tokens where ``seen`` (bool
    [B, V]: in the prompt or the response so far) a positive logit is divided by
    ``repetition_penalty`` and a negative one multiplied; then ``frequency_penalty * counts``
    (float [B, V]: the times each token is in the response so far) and ``presence_penalty`` where
    ``counts > 0`` are subtracted. A penalty left at its neutral value costs nothing."""
    out = logits
    if sampling.repetition_penalty != 1.0:
        scale = torch.where(out > 0, 1.0 / sampling.repetition_penalty, sampling.repetition_penalty)
        out = torch.where(seen, out * scale, out)
    if sampling.frequency_penalty != 0.0:
        out = out - sampling.frequency_penalty * counts
    if sampling.presence_penalty != 0.0:
        out = out - sampling.presence_penalty * (counts > 0)
    return out


def choose_tokens(
    logits: torch.Tensor,
    sampling: SamplingParams,
    *,
    blocked: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    penalised: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32) as the module docstring describes;
    ``blocked``: bool [V], the ids that may not be chosen (``None``: none); ``penalised``: the
    logits after :func:`apply_penalties`, which the choice reads instead (``None``: ``logits``).
    Only device operations, so it can be captured in a CUDA graph (the sampling draws from
    ``generator``, or torch's default generator of the logits' device, unless ``uniform`` gives
    the draws: :func:`uniform_draws`).

    Returns ``(tokens [B] long, logprobs [B] float32)``.
    """
    if sampling.greedy:
        tokens = block_tokens(logits if penalised is None else penalised, blocked).argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / sampling.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if penalised is not None:
            scaled = penalised / sampling.temperature
        filtered = top_p_filter(top_k_filter(block_tokens(scaled, blocked), sampling.top_k), sampling.top_p)
        filtered = min_p_filter(filtered, sampling.min_p)
        tokens = sample_rows(torch.softmax(filtered, dim=-1), generator, uniform)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def uniform_draws(rows: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """The uniform numbers one sampled choice of ``rows`` rows draws (:func:`sample_rows`): ``[rows,
    1]`` float64 in [0, 1) from ``generator`` (or the device's default generator). Drawn apart from
    the choice, they let the choice run in compiled code that takes no generator, from the same
    stream."""
    return torch.rand((rows, 1), generator=generator, device=device, dtype=torch.float64)


def sample_rows(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (each row's probabilities, summing to about 1), by the
    inverse of its cumulative distribution: with ``c_j = sum_{i<=j} p_i`` (float64) and one uniform
    ``u`` per row, the token is the first ``j`` with ``c_j > u * c_V``. Exactly ``p``'s distribution
    (a token of probability 0 adds nothing to ``c`` and is never chosen), from one random number per
    row: ``torch.multinomial`` draws one per vocabulary entry (an exponential race), which on a CPU
    took 12% of a 135M model's decoding at a 49k vocabulary. Device operations only (a CUDA graph
    can capture it). ``uniform``: the ``u`` of each row (:func:`uniform_draws`), else drawn here from
    ``generator``. Returns ``[B]`` long."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = uniform if uniform is not None else uniform_draws(probs.shape[0], probs.device, generator)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)  # u * c_V rounding to c_V itself


def check_sampling(sampling: SamplingParams) -> None:
    """Raise :class:`ValueError` for sampling settings no engine can honour."""
    problems = []
    if sampling.n < 1:
        problems.append(f"n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if sampling.min_new_tokens < 0:
        problems.append(f"min_new_tokens must be >= 0, got {sampling.min_new_tokens}")
    if not sampling.greedy and not sampling.temperature > 0:
        problems.append(f"temperature must be > 0 unless greedy, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {sampling.top_p}")
    if not 0 <= sampling.min_p < 1:
        problems.append(f"min_p must be in [0, 1), got {sampling.min_p}")
    if not sampling.repetition_penalty > 0:
        problems.append(f"repetition_penalty must be > 0, got {sampling.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(sampling, name) <= 2:
            problems.append(f"{name} must be in [-2, 2], got {getattr(sampling, name)}")
    if sampling.extra:
        problems.append(
            f"extra ({', '.join(sorted(sampling.extra))}) holds server parameters, and the hf engine samples in "
            "process; remove rollout.sampling.extra, or use vllm or sglang"
        )
    if problems:
        raise ValueError("invalid sampling parameters: " + "; ".join(problems))
