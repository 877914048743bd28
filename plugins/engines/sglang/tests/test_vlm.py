"""The tiny Qwen2-VL (:func:`core_rl.roles.tiny_vlm.build_tiny_vlm`) on a real SGLang CPU server
(from the managed ``sglang`` server environment): prompts with images pass the multimodal
conformance case (``check_multimodal_rollout``: sampled tokens and their log-probs against a
transformers forward of the same ids and pixels), the images change what the server samples, both
weight sync modes reach the vision tower, and ``core-rl train`` runs GRPO on image rows through it."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from core_rl import cli
from core_rl.builtin import read_metrics
from core_rl.config.loader import structure
from core_rl.interfaces import SamplingParams
from core_rl.roles.hf import save_pretrained
from core_rl.roles.tiny_vlm import build_tiny_vlm
from core_rl.testing.multimodal_contracts import check_multimodal_rollout, image_prompts, reference_logprobs
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine, placeholder_ids, served_name

pytestmark = pytest.mark.server_env("sglang")  # real SGLang servers (see the repository's conftest.py)

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", words=[*COLOURS, "colour?"], seed=0)


@pytest.fixture(scope="module")
def engine(vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    """A float32 server: its log-probs then equal a float32 transformers forward's to ~1e-5."""
    options = {"dtype": "float32", "max_running_requests": 16, "update_bucket_mb": 0.047}
    engine = SGLangRolloutEngine(vlm, structure(options, SGLangConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def perturbed_vision_tower(vlm: Path, seed: int):
    """The model of ``vlm`` with noise on every vision-tower weight (``model.visual.*``), the rest as it is."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.visual."):
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def masked_reference_logprobs(model_dir: Path, samples: list) -> list[torch.Tensor]:
    """Each sample's response log-probs under a float32 transformers forward of its ids and pixels,
    with the placeholder tokens masked out of the softmax, as SGLang reports them (the engine's
    ``logit_bias`` on them: :mod:`core_rl_sglang.engine`)."""
    return reference_logprobs(model_dir, samples, masked=placeholder_ids(model_dir))


def gaps(samples: list, model_dir: Path) -> list[float]:
    """For each sample, the largest gap between its log-probs and :func:`masked_reference_logprobs`'."""
    return [
        float((torch.tensor(s.logprobs) - ref).abs().max())
        for s, ref in zip(samples, masked_reference_logprobs(model_dir, samples))
    ]


def sample_and_compare(engine, model_dir: Path) -> list[float]:
    """Samples of the image prompts from ``engine``; for each, the largest gap between its log-probs
    and a transformers forward of ``model_dir`` over the same ids and pixels."""
    prompts, media = image_prompts(model_dir)
    groups = engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=4, temperature=1.0), media=media[:2])
    samples = [group[0] for group in groups]
    for s, m in zip(samples, media):
        s.media = m
    return gaps(samples, model_dir)


def test_the_sglang_engine_passes_the_multimodal_conformance_case(engine, vlm: Path) -> None:
    # the tolerance of the text conformance class (logprob_atol 2e-2): SGLang's log-probs leave the
    # placeholder tokens out of the softmax, the reference keeps them (~0.007 for this random model)
    samples = check_multimodal_rollout(engine, vlm, atol=2e-2)
    # against the same forward with the placeholders masked, a float32 server agrees to 1e-4
    assert max(gaps(samples, vlm)) < 1e-4
    # the images reach the model: the same ids without the pixels give other log-probs
    blind = [attrs.evolve(s, media=None) for s in samples if s.media is not None]
    assert min(gaps(blind, vlm)) > 1e-3
    # a vision-language model's placeholders are never sampled, even where the model favours them
    placeholders = set(placeholder_ids(vlm))
    assert placeholders and all(not placeholders & set(s.response_ids) for s in samples)


def test_weight_syncs_reach_the_vision_tower(engine, vlm: Path, tmp_path: Path) -> None:
    assert served_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert served_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert served_name("lm_head.weight") == "lm_head.weight"

    # disk: a Hugging Face directory of the model with a perturbed vision tower
    disk = tmp_path / "disk"
    save_pretrained(perturbed_vision_tower(vlm, seed=1), disk)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        (disk / extra).write_bytes((vlm / extra).read_bytes())
    assert max(sample_and_compare(engine, disk)) > 1e-3  # the server still holds the original tower
    engine.load_weights_from_path(disk, 1)
    assert max(sample_and_compare(engine, disk)) < 1e-4  # now the server's log-probs are the new model's

    # collective: the trainer's in-memory names (model.visual.*, model.language_model.*), another tower
    model = perturbed_vision_tower(vlm, seed=2)
    other = tmp_path / "collective"
    save_pretrained(model, other)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        (other / extra).write_bytes((vlm / extra).read_bytes())
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    assert any(name.startswith("model.visual.") for name in state)
    assert max(sample_and_compare(engine, other)) > 1e-3
    engine.update_weights_collective(state, 2)
    assert max(sample_and_compare(engine, other)) < 1e-4
    # back to the original weights for the other tests
    engine.load_weights_from_path(vlm, 3)


def write_colour_rows(folder: Path, count: int, *, answers: str = "answer", seed: int = 0) -> Path:
    """``count`` rows ``{"prompt": "colour?", "images": [...], "answer": colour}`` (16x16 PNGs of a
    coloured square on grey, colours in turn); with ``answers="response"`` each row's ``response`` is
    a colour drawn at random instead (the answer format, not the answer: a warm start's rows)."""
    import random

    from PIL import Image

    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    path = folder / f"{answers}.jsonl"
    with path.open("w") as f:
        for i in range(count):
            colour = names[i % len(names)]
            image = Image.new("RGB", (16, 16), (200, 200, 200))
            image.paste(COLOURS[colour], (4, 4, 12, 12))
            image.save(folder / "images" / f"{answers}_{i}.png")
            value = colour if answers == "answer" else rng.choice(names)
            f.write(json.dumps({"prompt": "colour?", "images": [f"images/{answers}_{i}.png"], answers: value}) + "\n")
    return path


@pytest.fixture(scope="module")
def warm_vlm(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM after 40 supervised steps on the answer format only (a colour word drawn at
    random): it answers with a colour, right about 1 time in 4, so GRPO's groups differ in reward."""
    from core_rl.roles.tiny import warm_start

    root = tmp_path_factory.mktemp("warm")
    data = write_colour_rows(root / "data", 128, answers="response")
    warm_start(
        vlm, root / "model_warm", data, steps=40, batch_size=32, lr=3e-3, data_options={"apply_chat_template": True}
    )
    return root / "model_warm"


@pytest.mark.parametrize("weight_sync", ["disk", "collective"])
def test_grpo_runs_through_core_rl_train_on_image_rows(tmp_path: Path, warm_vlm: Path, weight_sync: str) -> None:
    data = write_colour_rows(tmp_path, 16)
    config = {
        "experiment": {"name": "vlm", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "data": {"train_files": [str(data)], "apply_chat_template": True, "batch_size": 8},
        "actor": {"model_path": str(warm_vlm), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 2e-3}},
        "rollout": {
            "engine": {"name": "sglang", "dtype": "float32", "max_running_requests": 64},
            "weight_sync": weight_sync,
            "sampling": {"n": 8, "max_new_tokens": 4},
        },
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match", "answer_key": "answer"},
        "trainer": {"total_steps": 3, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [],
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    assert cli.main(["config", "validate", str(path)]) == 0
    assert cli.main(["train", str(path)]) == 0
    rows = [r for r in read_metrics(tmp_path / "runs" / "vlm" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 3 and all(r["actor/nonfinite"] == 0 for r in rows)
    # exact_match of the square's colour: the warm start answers with colour words, some right
    assert all(0.0 < r["reward/mean"] < 1.0 and r["reward/std"] > 0 for r in rows), [r["reward/mean"] for r in rows]
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # groups differ in reward: every step trains
    # the server sampled the ids and pixels the trainer computes log-probs over, with the trainer's
    # weights of the step before (the syncs reach it); what is left is the placeholders' share that
    # SGLang's log-probs leave out (core_rl_sglang.engine)
    assert all(r["mismatch/abs_logprob_diff"] < 2e-2 for r in rows), [r["mismatch/abs_logprob_diff"] for r in rows]
