"""Sampling from a vision-language model: prompts whose ids hold image placeholders, with their pixel inputs.

The model's own ``generate`` runs it (the multimodal position ids, e.g. Qwen2-VL's M-RoPE, and the
vision tower's pass at the prefill are the model's business), over left-padded prompts, each
repeated ``sampling.n`` times with its images. The behaviour log-prob of a sampled token is
``log_softmax(logits / temperature)`` at it (the raw logits of its step; the train engine computes
the same from a full forward over the right-padded row, :mod:`core_rl_train_kit.logprobs`; greedy
sampling reports temperature 1). The model's image and video placeholder tokens are never sampled
(a placeholder in a response would stand for an image the row does not have; their log-probs are
left in the softmax, so the reported log-probs are the model's). A response ends at its first stop
token (kept, ``"stop"``) or after ``max_new_tokens`` (``"length"``). Random draws come from
``generator`` (a seed drawn from it seeds a forked RNG), so a seeded engine repeats its samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from core_rl.interfaces import SamplingParams
from core_rl.vision.media import concat_media, forward_kwargs
from core_rl.vision.models import PLACEHOLDER_KEYS

from core_rl_hf.generation import Completion, left_pad

#: sampling settings this path does not implement (refused by :func:`unsupported_settings`); it takes
#: ``n``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``, ``min_new_tokens``,
#: ``stop_token_ids`` and ``greedy``
UNSUPPORTED = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "extra")


def unsupported_settings(sampling: SamplingParams) -> list[str]:
    """The settings of ``sampling`` away from their defaults that image prompts cannot use here."""
    defaults = SamplingParams()
    return [name for name in UNSUPPORTED if getattr(sampling, name) != getattr(defaults, name)]


def placeholder_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids that stand for image or video features in ``model``'s inputs (its config's
    :data:`~core_rl.vision.models.PLACEHOLDER_KEYS`), which a response must not hold."""
    config = model.config
    return sorted({int(v) for v in (getattr(config, n, None) for n in PLACEHOLDER_KEYS) if isinstance(v, int)})


@torch.inference_mode()
def generate_with_images(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    media: Sequence[Mapping[str, torch.Tensor] | None],
    sampling: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> list[list[Completion]]:
    """``sampling.n`` completions of each prompt, its images ``media[i]`` (``None``: none) passed
    with it (module docstring)."""
    unsupported = unsupported_settings(sampling)
    if unsupported:
        raise ValueError(
            f"hf rollout engine: sampling settings {', '.join(unsupported)} are not supported with image prompts"
        )
    device = next(model.parameters()).device
    input_ids, attention_mask, _ = left_pad(prompts, pad_token_id, device)
    images = {k: v.to(device) for k, v in concat_media([m for m in media if m is not None]).items()}
    stop_ids = sorted(set(eos_token_ids) | set(sampling.stop_token_ids))
    greedy = sampling.greedy or sampling.temperature == 0
    options: dict[str, object] = {
        "do_sample": not greedy,
        "max_new_tokens": sampling.max_new_tokens,
        "min_new_tokens": sampling.min_new_tokens,
        "num_return_sequences": sampling.n,
        "eos_token_id": stop_ids,
        "pad_token_id": pad_token_id,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    placeholders = placeholder_token_ids(model)
    if placeholders:
        options["suppress_tokens"] = placeholders
    if not greedy:
        options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item()) if generator is not None else None
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **forward_kwargs(model, input_ids, images),
            **options,
        )
    width = input_ids.shape[1]
    tokens = out.sequences[:, width:]
    if not out.logits:
        return [[Completion([], [], "length") for _ in range(sampling.n)] for _ in prompts]
    logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, vocab]
    scale = 1.0 if greedy else sampling.temperature
    logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, tokens[:, : logits.shape[1], None])[..., 0]
    stops = torch.tensor(stop_ids, device=tokens.device)
    results: list[list[Completion]] = []
    for i in range(len(prompts)):
        group = []
        for row in range(i * sampling.n, (i + 1) * sampling.n):
            ids = tokens[row, : logits.shape[1]].tolist()
            hit = torch.isin(tokens[row, : logits.shape[1]], stops).nonzero()
            end = int(hit[0]) + 1 if len(hit) else len(ids)
            reason = "stop" if len(hit) else "length"
            group.append(Completion(ids[:end], logprobs[row, :end].tolist(), reason))
        results.append(group)
    return results
