"""Batched autoregressive sampling with a KV cache over left-padded prompts.

Prompts of different lengths are right-aligned (left padding) so every row's next token sits in the
last column. Position ids count real tokens only (``position = cumsum(mask) - 1``), so a padded row
sees exactly the positions, and hence the logits, it would see alone; padded columns are masked out
of attention. Each step feeds one new token per row with the cache of the previous steps.

A row finishes when it produces a stop token (EOS or one of ``stop_token_ids``) at step
``t >= min_new_tokens`` (before that, stop tokens are blocked); its response is the tokens up to and
including that token (``"stop"``). Rows still running after ``max_new_tokens`` steps end with
``"length"``. Finished rows keep being fed a filler token until every row is done; what they produce
then is discarded.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from core_rl.interfaces import SamplingParams
from core_rl_hf.sampling import choose_tokens


@attrs.define
class Completion:
    """One generated response: token ids, their behaviour log-probs, and ``"stop"``/``"length"``."""

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
    sampling: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """Generate one response per prompt (all prompts non-empty) in one batch; see the module docstring."""
    device = next(model.parameters()).device
    stop_ids = sorted(set(eos_token_ids) | set(sampling.stop_token_ids))
    stop_tensor = torch.as_tensor(stop_ids, dtype=torch.long, device=device)
    input_ids, attention_mask, position_ids = left_pad(prompts, pad_token_id, device)
    batch, steps = len(prompts), sampling.max_new_tokens
    tokens = torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), steps, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    cache = None
    for t in range(steps):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        blocked = stop_ids if t < sampling.min_new_tokens else ()
        next_tokens, next_logprobs = choose_tokens(
            out.logits[:, -1].float(), sampling, blocked=blocked, generator=generator
        )
        tokens[:, t] = next_tokens
        logprobs[:, t] = next_logprobs
        stopped = ~finished & torch.isin(next_tokens, stop_tensor)
        lengths[stopped] = t + 1
        finished |= stopped
        if t + 1 == steps or bool(finished.all()):
            break
        input_ids = next_tokens.masked_fill(finished, pad_token_id)[:, None]
        position_ids = position_ids[:, -1:] + 1
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    lengths_l, finished_l = lengths.tolist(), finished.tolist()
    return [
        Completion(
            token_ids=tokens_l[i][: lengths_l[i]],
            logprobs=logprobs_l[i][: lengths_l[i]],
            finish_reason="stop" if finished_l[i] else "length",
        )
        for i in range(batch)
    ]
