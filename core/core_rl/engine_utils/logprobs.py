"""Per-token log-probabilities and entropies from causal-LM logits, in the protocol's alignment."""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) ``[b, t]`` float32 aligned with ``input_ids``.

    With ``z_{t-1} = logits[:, t-1] / temperature`` (the prediction of token ``t``), for ``t >= 1``:

    - ``logprob[:, t] = log_softmax(z_{t-1})[input_ids[:, t]]``
    - ``entropy[:, t] = -sum_v p_v log p_v`` with ``p = softmax(z_{t-1})``

    Position 0 (no prediction) and padding (``attention_mask == 0``) hold 0; padding is zeroed
    with ``where`` (not a product) so a non-finite value there cannot leak into sums.
    ``entropy_grad=False`` computes the entropy without gradient (a metric only): its
    ``[b, t, V]`` probabilities are then not kept for backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    logprobs = align_to_tokens(picked, attention_mask)
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)
    return logprobs, align_to_tokens(ent, attention_mask)


def align_to_tokens(per_prediction: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b, T-1]`` values of the predictions made at positions ``0..T-2`` (of tokens ``1..T-1``)
    placed on the tokens they predict: ``[b, T]`` with column 0 and padding set to 0 (with
    ``where``, so a non-finite value on padding cannot leak). Engines that compute log-probs their
    own way (e.g. on vocabulary-parallel logits) use it to keep the same alignment."""
    real = attention_mask[:, 1:] != 0
    zero_col = per_prediction.new_zeros(per_prediction.shape[0], 1)
    return torch.cat([zero_col, torch.where(real, per_prediction, torch.zeros_like(per_prediction))], dim=1)
