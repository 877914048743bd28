"""Batched autoregressive sampling with a KV cache over left-padded prompts.

Prompts of different lengths are right-aligned (left padding) so every row's next token sits in the
last column. Position ids count real tokens only (``position = cumsum(mask) - 1``), so a padded row
sees exactly the positions, and hence the logits, it would see alone; padded columns are masked out
of attention.

Each distinct prompt is run through the model once (the prefill); its KV cache, attention mask and
next-token logits are then repeated for the ``count`` samples drawn from it. Each later step feeds
one new token per row with the cache of the previous steps.

A row finishes when it produces a stop token (EOS or one of ``stop_token_ids``); stop tokens are
blocked while fewer than ``min_new_tokens`` tokens exist. Its response is the tokens up to and
including that token (``"stop"``). Rows still running after ``max_new_tokens`` tokens end with
``"length"``. A row still running when ``interrupted()`` turns true (checked before each token
after the first) ends with ``"abort"`` and the tokens it has; the caller continues it later.
Finished rows are dropped from the batch (and the cache) once they make up a quarter of it; until
then they are fed a filler token whose outputs are discarded. The KV cache is
preallocated for the prompt plus ``max_new_tokens`` positions. Each decoding step runs through a
stepper (:mod:`core_rl_hf.decode`): the lean path for Llama and Qwen2 models, the model's own
forward otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
from core_rl.interfaces import SamplingParams

from core_rl_hf.decode import make_stepper, mixed_precision
from core_rl_hf.sampling import choose_tokens


@attrs.define
class Completion:
    """One generated response: token ids, their behaviour log-probs, and ``"stop"``/``"length"``
    (or ``"abort"``: interrupted, see :func:`generate_batch`)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-align ``prompts`` into ``(input_ids, attention_mask, position_ids)``, each [B, L].

    ``position_ids`` is ``cumsum(attention_mask) - 1`` on real tokens and 0 on padding.
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if prompt:
            input_ids[i, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    sampling: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    interrupted: Callable[[], bool] | None = None,
    lean: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> list[list[Completion]]:
    """``counts[i]`` responses to each (non-empty) ``prompts[i]``, all generated as one batch; see
    the module docstring. ``sampling.n`` is ignored (``counts`` says how many). ``lean``: decode
    supported architectures with :class:`core_rl_hf.decode.LeanStepper`; ``compute_dtype``: mixed
    precision (the prefill under autocast, the steps as :mod:`core_rl_hf.decode` describes)."""
    device = next(model.parameters()).device
    stop_ids = sorted(set(eos_token_ids) | set(sampling.stop_token_ids))
    stop_tensor = torch.as_tensor(stop_ids, dtype=torch.long, device=device)
    input_ids, attention_mask, position_ids = left_pad(prompts, pad_token_id, device)
    with mixed_precision(model, compute_dtype):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
    # one row per sample: repeat each prompt's cache, mask and logits counts[i] times
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.as_tensor(counts, device=device))
    cache = out.past_key_values
    cache.reorder_cache(rows)
    capacity = input_ids.shape[1] + sampling.max_new_tokens
    stepper = make_stepper(
        model, cache, attention_mask[rows], position_ids[rows, -1:], capacity, lean=lean, compute_dtype=compute_dtype
    )
    logits = out.logits[rows, -1].float()
    del out, cache

    total, steps = len(rows), sampling.max_new_tokens
    tokens = torch.full((total, steps), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((total, steps), dtype=torch.float32, device=device)
    lengths = torch.full((total,), steps, dtype=torch.long, device=device)
    stopped = torch.zeros(total, dtype=torch.bool, device=device)
    sequence = torch.arange(total, device=device)  # the sample each batch row generates
    done = torch.zeros(total, dtype=torch.bool, device=device)  # batch rows already finished
    aborted = False
    for t in range(steps):
        if t > 0 and interrupted is not None and interrupted():
            aborted = True
            lengths[sequence[~done]] = t
            break
        blocked = stop_ids if t < sampling.min_new_tokens else ()
        next_tokens, next_logprobs = choose_tokens(logits, sampling, blocked=blocked, generator=generator)
        live = sequence[~done]
        tokens[live, t] = next_tokens[~done]
        logprobs[live, t] = next_logprobs[~done]
        new_stop = ~done & torch.isin(next_tokens, stop_tensor)
        lengths[sequence[new_stop]] = t + 1
        stopped[sequence[new_stop]] = True
        done |= new_stop
        n_done = int(done.sum())
        if t + 1 == steps or n_done == len(done):
            break
        if 4 * n_done >= len(done):
            keep = (~done).nonzero().squeeze(-1)
            stepper.keep(keep)
            sequence, next_tokens, done = sequence[keep], next_tokens[keep], done[keep]
        logits = stepper.step(next_tokens.masked_fill(done, pad_token_id))

    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    lengths_l, stopped_l = lengths.tolist(), stopped.tolist()
    completions = [
        Completion(
            token_ids=tokens_l[i][: lengths_l[i]],
            logprobs=logprobs_l[i][: lengths_l[i]],
            finish_reason="stop" if stopped_l[i] else ("abort" if aborted and lengths_l[i] < steps else "length"),
        )
        for i in range(total)
    ]
    grouped, start = [], 0
    for count in counts:
        grouped.append(completions[start : start + count])
        start += count
    return grouped
