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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) ``[b, t]`` float32 aligned with ``input_ids``.

    With ``z_{t-1} = logits[:, t-1] / temperature`` (the prediction of token ``t``), for ``t >= 1``:

    - ``logprob[:, t] = log_softmax(z_{t-1})[input_ids[:, t]]``
    - ``entropy[:, t] = -sum_v p_v log p_v`` with ``p = softmax(z_{t-1})``

    Position 0 (no prediction) and padding (``attention_mask == 0``) hold 0; padding is zeroed
    with ``where`` (not a product) so a non-finite value there cannot leak into sums.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b = input_ids.shape[0]
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    real = attention_mask[:, 1:] != 0
    zero_col = picked.new_zeros(b, 1)
    logprobs = torch.cat([zero_col, torch.where(real, picked, torch.zeros_like(picked))], dim=1)
    if not with_entropy:
        return logprobs, None
    ent = -(logp.exp() * logp).sum(-1)
    entropy = torch.cat([zero_col, torch.where(real, ent, torch.zeros_like(ent))], dim=1)
    return logprobs, entropy
