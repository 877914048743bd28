"""The conformance case of engines that claim ``multimodal`` (:mod:`core_rl.vision.engines`).

Given a vision-language model directory (e.g. :func:`core_rl.testing.tiny_vlm.build_tiny_vlm`'s):

- :func:`check_multimodal_rollout`: a rollout engine samples prompts with images (passed as
  ``media``) and reports, for every sampled token, the log-prob a transformers forward of the same
  ids and pixels gives (within ``atol``); no response holds an image placeholder token; a prompt
  of the same call without images is served too.
- :func:`check_multimodal_train`: a train engine's ``compute_logprobs`` of a batch with pixel
  inputs equals that forward's, row by row, whatever rows share a micro-batch.

The server engines' VLM tests share the rest: what their conformance case adds
(:func:`check_images_reach_the_model`: log-probs against the forward with the placeholders they
ban masked, :func:`masked_gaps`; :func:`check_cached_prefix_keeps_its_image`: a prefix cache
never serves one image's keys and values for another's prompt), weight syncs reaching the vision tower
(:func:`check_vision_tower_syncs`) and a GRPO run on image rows (:func:`write_colour_rows`,
:func:`warm_colour_vlm`, :func:`check_image_grpo`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from core_rl.interfaces import RolloutEngine, SamplingParams, TrainEngine
from core_rl.protocol import Sample, TensorBatch, samples_to_batch
from core_rl.vision.media import forward_kwargs
from core_rl.vision.models import placeholder_ids


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
    placeholders = set(placeholder_ids(model_dir))
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


# -- helpers of the server engines' VLM tests (a real server serving the tiny Qwen2-VL) --------

#: the square colours of :func:`write_colour_rows` (and the tiny VLM's words)
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}
#: the files beside a vision-language model's weights that a server loading a directory reads
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json")


def perturbed_vision_tower(vlm: str | Path, seed: int) -> Any:
    """The model of ``vlm`` (float32) with noise on every vision-tower weight (``model.visual.*``),
    the rest as it is."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.visual."):
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def save_beside(model: Any, vlm: str | Path, target: Path) -> Path:
    """``model`` saved as a Hugging Face directory ``target`` with ``vlm``'s :data:`PROCESSOR_FILES`."""
    from core_rl.roles.hf import save_pretrained

    save_pretrained(model, target)
    for name in PROCESSOR_FILES:
        (target / name).write_bytes((Path(vlm) / name).read_bytes())
    return target


def masked_gaps(samples: list[Sample], model_dir: str | Path) -> list[float]:
    """For each sample (its ``media`` set), the largest gap between its log-probs and a float32
    transformers forward of ``model_dir`` over its ids and pixels with the model's placeholder tokens
    masked out of the softmax (an engine that bans them: :func:`reference_logprobs`)."""
    reference = reference_logprobs(model_dir, samples, masked=placeholder_ids(model_dir))
    return [float((torch.tensor(s.logprobs) - ref).abs().max()) for s, ref in zip(samples, reference)]


def sample_and_compare(engine: RolloutEngine, model_dir: str | Path) -> list[float]:
    """One sample of each image prompt of :func:`image_prompts` from ``engine``; for each, its
    :func:`masked_gaps` against ``model_dir``."""
    prompts, media = image_prompts(model_dir)
    groups = engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=4, temperature=1.0), media=media[:2])
    samples = [group[0] for group in groups]
    for s, m in zip(samples, media):
        s.media = m
    return masked_gaps(samples, model_dir)


def check_images_reach_the_model(samples: list[Sample], model_dir: str | Path, *, atol: float = 1e-4) -> None:
    """For an engine that bans the placeholder tokens (e.g. SGLang's and vLLM's logit bias), over
    :func:`check_multimodal_rollout`'s ``samples``: their log-probs equal the :func:`masked_gaps`
    forward within ``atol``; the same ids without the pixels, or with the other prompt's, give
    other log-probs (each prompt of the batch was sampled with its own image); no response holds a
    placeholder."""
    assert max(masked_gaps(samples, model_dir)) < atol
    with_images = [s for s in samples if s.media is not None]
    blind = [attrs.evolve(s, media=None) for s in with_images]
    assert min(masked_gaps(blind, model_dir)) > 1e-3, "the same ids without the pixels give the same log-probs"
    first, second = with_images[0].media, with_images[-1].media
    assert first is not second
    swapped = [attrs.evolve(s, media=second if s.media is first else first) for s in with_images]
    assert min(masked_gaps(swapped, model_dir)) > 1e-3, "a prompt was sampled with another prompt's image"
    placeholders = set(placeholder_ids(model_dir))
    assert placeholders and all(not placeholders & set(s.response_ids) for s in samples)


def check_cached_prefix_keeps_its_image(engine: RolloutEngine, model_dir: str | Path, *, atol: float = 1e-4) -> None:
    """Two calls, one after the other, each with one prompt of :func:`image_prompts`: the same ids
    (same text, same placeholder count) and another image. The second must be sampled with its own
    image, not the first's: an engine with a prefix cache keyed by token ids alone would reuse the
    first prompt's cached keys and values, computed from the other image. Log-probs as in
    :func:`check_images_reach_the_model`."""
    prompts, media = image_prompts(model_dir)
    assert prompts[0] == prompts[1], "the two image prompts must have the same ids"
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    samples = []
    for prompt, pixels in zip(prompts[:2], media[:2]):
        (group,) = engine.generate([prompt], params, media=[pixels])
        for s in group:
            s.media = pixels
        samples.extend(group)
    gaps = masked_gaps(samples, model_dir)
    assert max(gaps) < atol, f"a prompt sampled after another with the same ids and another image: gaps {gaps}"
    swapped = [attrs.evolve(s, media=media[1] if s.media is media[0] else media[0]) for s in samples]
    assert min(masked_gaps(swapped, model_dir)) > 1e-3, "the two images give the same log-probs"


def check_vision_tower_syncs(engine: Any, vlm: str | Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Both weight syncs of a server engine serving ``vlm`` reach its vision tower: a disk update of
    a perturbed tower (version 1), then a collective update of the trainer's in-memory state dict
    (``model.visual.*``, ``model.language_model.*``) of another (version 2); before each, the
    server's log-probs are not the new model's, after it they are (:func:`sample_and_compare`
    within 1e-4). Returns the disk update's directory and the collective's state dict (for an
    engine's own checks of them); the engine serves the collective's weights at the end."""
    disk = save_beside(perturbed_vision_tower(vlm, seed=1), vlm, folder / "disk")
    assert max(sample_and_compare(engine, disk)) > 1e-3  # the server still holds the original tower
    engine.load_weights_from_path(disk, 1)
    assert max(sample_and_compare(engine, disk)) < 1e-4  # now the server's log-probs are the new model's

    model = perturbed_vision_tower(vlm, seed=2)
    other = save_beside(model, vlm, folder / "collective")
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    assert any(name.startswith("model.visual.") for name in state)
    assert max(sample_and_compare(engine, other)) > 1e-3
    engine.update_weights_collective(state, 2)
    assert max(sample_and_compare(engine, other)) < 1e-4
    return disk, state


def write_colour_rows(folder: Path, count: int, *, answers: str = "answer", seed: int = 0) -> Path:
    """``count`` rows ``{"prompt": "colour?", "images": [...], "answer": colour}`` (16x16 PNGs of a
    coloured square on grey, :data:`COLOURS` in turn) in ``folder / f"{answers}.jsonl"``; with
    ``answers="response"`` each row's ``response`` is a colour drawn at random instead (the answer
    format, not the answer: a warm start's rows)."""
    import random

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    path = folder / f"{answers}.jsonl"
    with path.open("w") as f:
        for i in range(count):
            colour = names[i % len(names)]
            _square(COLOURS[colour]).save(folder / "images" / f"{answers}_{i}.png")
            value = colour if answers == "answer" else rng.choice(names)
            f.write(json.dumps({"prompt": "colour?", "images": [f"images/{answers}_{i}.png"], answers: value}) + "\n")
    return path


def warm_colour_vlm(vlm: str | Path, root: Path) -> Path:
    """The tiny VLM ``vlm`` after 40 supervised steps (in ``root / "model_warm"``) on the answer
    format only (:func:`write_colour_rows` with ``answers="response"``): it answers with a colour,
    right about 1 time in 4, so GRPO's groups differ in reward."""
    from core_rl.testing.tiny import warm_start

    data = write_colour_rows(root / "data", 128, answers="response")
    warm_start(
        vlm, root / "model_warm", data, steps=40, batch_size=32, lr=3e-3, data_options={"apply_chat_template": True}
    )
    return root / "model_warm"


def check_image_grpo(folder: Path, model: str | Path, engine: dict[str, Any], weight_sync: str, atol: float) -> None:
    """``core-rl config validate`` and ``core-rl train``: 3 GRPO steps (fsdp actor, ``engine`` as
    ``rollout.engine``, ``weight_sync``) on 16 :func:`write_colour_rows` rows from ``model`` (e.g.
    :func:`warm_colour_vlm`'s), in ``folder``. Every step trains (groups differ in reward, finite
    gradients) and its ``mismatch/abs_logprob_diff`` is below ``atol``: the server sampled the ids
    and pixels the trainer computes log-probs over, with the weights of the step before."""
    from core_rl import cli
    from core_rl.builtin import read_metrics

    data = write_colour_rows(folder, 16)
    config = {
        "experiment": {"name": "vlm", "output_dir": str(folder / "runs"), "seed": 0},
        "data": {"train_files": [str(data)], "apply_chat_template": True, "batch_size": 8},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 2e-3}},
        "rollout": {"engine": engine, "weight_sync": weight_sync, "sampling": {"n": 8, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match", "answer_key": "answer"},
        "trainer": {"total_steps": 3, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [],
    }
    path = folder / "config.yaml"
    path.write_text(json.dumps(config))
    assert cli.main(["config", "validate", str(path)]) == 0
    assert cli.main(["train", str(path)]) == 0
    rows = [r for r in read_metrics(folder / "runs" / "vlm" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3 and all(r["actor/nonfinite"] == 0 for r in rows)
    # exact_match of the square's colour: the warm start answers with colour words, some right
    assert all(0.0 < r["reward/mean"] < 1.0 and r["reward/std"] > 0 for r in rows), [r["reward/mean"] for r in rows]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["mismatch/abs_logprob_diff"] < atol for r in rows), [r["mismatch/abs_logprob_diff"] for r in rows]
