"""The conformance case of engines that claim ``multimodal`` (:mod:`core_rl.vision.engines`).

Given a vision-language model directory (e.g. :func:`core_rl.roles.tiny_vlm.build_tiny_vlm`'s):

- :func:`check_multimodal_rollout`: a rollout engine samples prompts with images (passed as
  ``media``) and reports, for every sampled token, the log-prob a transformers forward of the same
  ids and pixels gives (within ``atol``); no response holds an image placeholder token; a prompt
  of the same call without images is served too.
- :func:`check_multimodal_train`: a train engine's ``compute_logprobs`` of a batch with pixel
  inputs equals that forward's, row by row, whatever rows share a micro-batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from core_rl.interfaces import RolloutEngine, SamplingParams, TrainEngine
from core_rl.protocol import Sample, TensorBatch, samples_to_batch
from core_rl.vision.media import forward_kwargs


def _square(colour: tuple[int, int, int], size: int = 16) -> Any:
    from PIL import Image

    image = Image.new("RGB", (size, size), (200, 200, 200))
    image.paste(colour, (4, 4, 12, 12))
    return image


def image_prompts(model_dir: str | Path) -> tuple[list[list[int]], list[dict[str, torch.Tensor] | None]]:
    """Three prompts of ``model_dir``'s chat template: two with one image each (different
    colours), one without; their ids and pixel inputs (``None`` for the text one)."""
    from transformers import AutoTokenizer

    from core_rl.vision.prompts import encode_vision_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, media = [], []
    for colour in ((220, 30, 30), (30, 60, 220)):
        ids, _, pixels = encode_vision_prompt(
            {"images": [_square(colour)]},
            "colour?",
            tokenizer,
            image_key="images",
            max_images=1,
            system_prompt=None,
            template_kwargs={},
        )
        prompts.append(ids)
        media.append(pixels)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "colour?"}], add_generation_prompt=True, tokenize=False
    )
    prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    media.append(None)
    return prompts, media


def reference_logprobs(model_dir: str | Path, samples: list[Sample], masked: Sequence[int] = ()) -> list[torch.Tensor]:
    """Each sample's response log-probs under a float32 transformers forward of its ids and pixels;
    with the tokens ``masked`` left out of the softmax (an engine that never samples them and
    reports log-probs over the rest, e.g. SGLang's logit bias on a VLM's placeholders)."""
    from core_rl.vision.models import auto_model_class

    model = auto_model_class(model_dir).from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids, **forward_kwargs(model, ids, s.media or {})).logits[0].float()
            if masked:
                logits[:, list(masked)] = float("-inf")
            logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logprobs[len(s.prompt_ids) - 1 :])
    return out


def check_multimodal_rollout(engine: RolloutEngine, model_dir: str | Path, *, atol: float = 1e-4) -> list[Sample]:
    """The rollout half of the module docstring; returns the samples (their ``media`` set)."""
    prompts, media = image_prompts(model_dir)
    groups = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, temperature=1.0), media=media)
    assert len(groups) == len(prompts), f"{len(groups)} groups for {len(prompts)} prompts"
    config = json.loads((Path(model_dir) / "config.json").read_text())
    placeholders = {config.get(k) for k in ("image_token_id", "video_token_id")} - {None}
    samples = []
    for prompt, pixels, group in zip(prompts, media, groups):
        assert len(group) == 2, f"{len(group)} samples for n=2"
        for s in group:
            assert s.prompt_ids == prompt, "a sample's prompt_ids must be the prompt's, placeholders included"
            assert not placeholders & set(s.response_ids), f"a response holds an image placeholder: {s.response_ids}"
            s.media = pixels
            samples.append(s)
    for s, expected in zip(samples, reference_logprobs(model_dir, samples)):
        got = torch.tensor(s.logprobs)
        assert torch.allclose(got, expected, atol=atol), f"behaviour log-probs {got} != transformers' {expected}"
    return samples


def check_multimodal_train(engine: TrainEngine, model_dir: str | Path, samples: list[Sample], *, atol: float = 1e-4):
    """The train half of the module docstring, over ``samples`` (e.g. :func:`check_multimodal_rollout`'s)."""
    batch: TensorBatch = samples_to_batch(samples, list(range(len(samples))), pad_token_id=0)
    got = engine.compute_logprobs(batch)
    for row, (s, expected) in enumerate(zip(samples, reference_logprobs(model_dir, samples))):
        start = len(s.prompt_ids)
        have = got[row, start : start + len(s.response_ids)]
        assert torch.allclose(have, expected, atol=atol), (
            f"row {row}: train log-probs {have} != transformers' {expected}"
        )
