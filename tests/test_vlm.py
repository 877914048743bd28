"""Vision-language models (:mod:`core_rl.vision`): the tiny Qwen2-VL built offline, rows with
images turned into ids and pixel inputs, pixel inputs kept with their rows in batches, the ``hf``
engine sampling with images and the ``fsdp`` and ``deepspeed`` engines computing the same log-probs,
bad images and engines that take no images refused before a run, and short GRPO, SFT and DPO runs
on image rows, on one and two ranks."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import pytest
import torch
from core_rl import cli
from core_rl.config.schema import DataConfig
from core_rl.data.files import DataRow
from core_rl.data.prompts import tokenise_rows
from core_rl.interfaces import LossOutput, SamplingParams
from core_rl.protocol import Sample, TensorBatch, concat_padded, samples_to_batch
from core_rl.testing.helpers import build_rollout_engine
from core_rl.testing.tiny_vlm import IMAGE_PAD, build_tiny_vlm
from core_rl.vision.media import row_media
from core_rl_train_kit.microbatch import take_micro_batch
from PIL import Image
from vlm_ranks_worker import train_engine

REWARDS = Path(__file__).with_name("reward_functions.py")
#: the train engines claiming ``multimodal`` (:func:`vlm_ranks_worker.train_engine`'s specs)
TRAIN_ENGINES = ["fsdp", "deepspeed"]
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", words=[*COLOURS, "colour?"], seed=0)


@pytest.fixture(scope="module")
def tokenizer(vlm: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm)


def square(colour: str, size: int = 16) -> Image.Image:
    image = Image.new("RGB", (size, size), (200, 200, 200))
    image.paste(COLOURS[colour], (4, 4, 12, 12))
    return image


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def write_rows(folder: Path, count: int = 16, *, key: str = "answer", seed: int = 0) -> Path:
    """``count`` rows ``{"prompt": "colour?", "images": ["images/i.png"], key: colour}`` and their PNGs."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    rng = random.Random(seed)
    path = folder / "train.jsonl"
    with path.open("w") as f:
        for i in range(count):
            colour = names[i % len(names)]
            square(colour).save(folder / "images" / f"{i}.png")
            row = {"prompt": "colour?", "images": [f"images/{i}.png"], key: colour}
            if key == "chosen":
                row["rejected"] = rng.choice([c for c in names if c != colour])
            f.write(json.dumps(row) + "\n")
    return path


def rows_of(path: Path) -> list[DataRow]:
    lines = path.read_text().splitlines()
    return [DataRow(file=str(path), line=i + 1, row=json.loads(line)) for i, line in enumerate(lines)]


# -- the model ----------------------------------------------------------------------------------


def test_tiny_vlm_reloads_offline_with_the_family_special_tokens(vlm: Path, tokenizer) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm, local_files_only=True)
    processor = AutoImageProcessor.from_pretrained(vlm, local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert any(name.startswith("model.visual.") for name, _ in model.named_parameters())
    for token in ("<|vision_start|>", IMAGE_PAD, "<|vision_end|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    out = processor(images=[square("red")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]  # 16x16 pixels, patch 4


# -- data ---------------------------------------------------------------------------------------


def test_images_column_and_content_parts_give_the_same_ids_and_pixels(tmp_path: Path, tokenizer) -> None:
    """A path in ``images``, a data: URI in an ``image_url`` part and bytes in an ``image`` part of
    the same picture give the same tokens (one ``<|image_pad|>`` per 2x2 merged patches) and pixels."""
    square("blue").save(tmp_path / "b.png")
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(square("blue"))).decode()
    message = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "colour?"}],
        }
    ]
    parts = [
        {
            "role": "user",
            "content": [{"type": "image", "image": png_bytes(square("blue"))}, {"type": "text", "text": "colour?"}],
        }
    ]
    rows = [
        DataRow(str(tmp_path / "d.jsonl"), 1, {"prompt": "colour?", "images": [str(tmp_path / "b.png")]}),
        DataRow(str(tmp_path / "d.jsonl"), 2, {"prompt": message}),
        DataRow(str(tmp_path / "d.jsonl"), 3, {"prompt": parts}),
    ]
    items, problems = tokenise_rows(rows, DataConfig(apply_chat_template=True), tokenizer)
    assert problems == []
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert items[0].prompt_ids.count(pad) == 4  # (4 * 4 patches) / merge 2x2
    for item in items[1:]:
        assert item.prompt_ids == items[0].prompt_ids
        assert torch.equal(item.media["pixel_values"], items[0].media["pixel_values"])
    assert items[0].media["pixel_values"].shape == (16, 3 * 2 * 4 * 4)
    assert items[0].media["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_text_rows_of_a_vision_model_carry_no_media(tokenizer) -> None:
    items, problems = tokenise_rows(
        [DataRow("d.jsonl", 1, {"prompt": "colour?"})], DataConfig(apply_chat_template=True), tokenizer
    )
    assert problems == [] and items[0].media is None


@pytest.mark.parametrize(
    ("images", "expected"),
    [
        (["missing.png"], "d.jsonl:1: image file 'missing.png' does not exist"),
        (["bad.png"], "d.jsonl:1: image file 'bad.png' cannot be decoded as an image"),
        (["ok.png"] * 3, "d.jsonl:1: the row has 3 images, more than data.max_images_per_prompt=2"),
        (["http://example.com/a.png"], "is a URL; a run reads no network"),
    ],
)
def test_bad_images_are_problems_naming_the_row(tmp_path: Path, tokenizer, images: list[str], expected: str) -> None:
    (tmp_path / "bad.png").write_bytes(b"not a png")
    square("red").save(tmp_path / "ok.png")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "colour?", "images": images}) + "\n")
    _, problems = tokenise_rows(rows_of(data), DataConfig(apply_chat_template=True, max_images_per_prompt=2), tokenizer)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_bad_image_stops_core_rl_train_with_exit_2_and_no_traceback(tmp_path: Path, vlm: Path, capsys) -> None:
    data = write_rows(tmp_path)
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({"prompt": "colour?", "images": ["images/nowhere.png"], "answer": "red"})
    data.write_text("\n".join(lines) + "\n")
    config = grpo_config(tmp_path, vlm, data, steps=1)
    code = cli.main(["train", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}:3: image file 'images/nowhere.png' does not exist" in err
    assert "Traceback" not in err


#: ``core-rl ARGS`` as on an install without Pillow (core-rl's own dependencies do not bring it)
CLI_WITHOUT_PILLOW = """
import sys
sys.modules["PIL"] = None  # import PIL raises ImportError, as where the package is absent
from core_rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_pillow_a_vlm_run_stops_with_one_problem_naming_the_extra(tmp_path: Path, vlm: Path) -> None:
    """Every image row would fail alike (the image processor needs Pillow): the preflight says it
    once, naming the key and the extra, and lists no row; a text model is unaffected."""
    import subprocess
    import sys

    config = grpo_config(tmp_path, vlm, write_rows(tmp_path, count=8), steps=1)
    run = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_PILLOW, "train", str(config)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2, run.stderr
    problems = [line for line in run.stderr.splitlines() if line.lstrip().startswith("- ")]
    assert problems == [
        f"  - actor.model_path: {vlm} is a vision-language model, and reading its images needs Pillow, which is not "
        'installed; pip install "core-rl[vision]" (or pip install pillow)'
    ], run.stderr
    assert "Traceback" not in run.stderr and "train.jsonl" not in run.stderr

    from core_rl.vision.images import missing_pillow_problems

    assert missing_pillow_problems(vlm, "actor.model_path") == []  # Pillow is installed here
    text_model = tmp_path / "text"
    text_model.mkdir()
    (text_model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert missing_pillow_problems(text_model, "actor.model_path") == []


# -- batches ------------------------------------------------------------------------------------


def media(patches: int, value: float, images: int = 1) -> dict[str, torch.Tensor]:
    per = patches // images
    side = int(per**0.5)
    return {
        "pixel_values": torch.full((patches, 6), value),
        "image_grid_thw": torch.tensor([[1, side, per // side]] * images),
    }


def test_pixel_inputs_stay_with_their_rows_through_batches_and_micro_batches() -> None:
    samples = [
        Sample([1, 2, 3], [4], [-0.5], 0, "stop", media=media(4, 1.0)),
        Sample([1, 2], [4, 5], [-0.1, -0.2], 0, "stop"),  # text only
        Sample([1, 2, 3, 3], [4], [-0.3], 0, "stop", media=media(8, 3.0, images=2)),
    ]
    batch = samples_to_batch(samples, [0, 1, 2], pad_token_id=0)
    assert batch["pixel_values"].shape == (3, 8, 6) and batch["image_grid_thw"].shape == (3, 2, 3)
    mb = take_micro_batch(batch, [2, 0], width=5)
    got = row_media(mb)
    assert got["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 2]]
    assert got["pixel_values"].shape == (12, 6)
    assert got["pixel_values"][:8].eq(3.0).all() and got["pixel_values"][8:].eq(1.0).all()
    assert row_media(batch, [1]) == {}
    # a batch whose rows hold fewer patches is padded to the widest when batches are joined
    other = samples_to_batch([Sample([1], [2], [-1.0], 0, "stop", media=media(4, 7.0))], [0], pad_token_id=0)
    joined = concat_padded([batch, other], pad_token_id=0)
    assert joined["pixel_values"].shape == (4, 8, 6)
    assert row_media(joined, [3])["pixel_values"].eq(7.0).all()


def test_take_micro_batch_never_cuts_pixel_rows_that_happen_to_match_the_width() -> None:
    samples = [Sample([1, 2, 3], [4], [-0.5], 0, "stop", media=media(4, 1.0))]
    batch = samples_to_batch(samples, [0], pad_token_id=0)
    assert batch["pixel_values"].shape[1] == batch["input_ids"].shape[1] == 4
    assert take_micro_batch(batch, [0], width=2)["pixel_values"].shape == (1, 4, 6)


# -- engines ------------------------------------------------------------------------------------


def engine_or_skip(spec: str, vlm: Path, **actor: object):
    """:func:`vlm_ranks_worker.train_engine`, skipping the test where the engine is not installed."""
    pytest.importorskip(f"core_rl_{spec.partition('-zero')[0]}")
    return train_engine(spec, vlm, **actor)


@pytest.mark.parametrize("engine_spec", TRAIN_ENGINES)
def test_hf_samples_with_images_and_the_train_engine_computes_the_same_logprobs(
    tmp_path: Path, vlm: Path, tokenizer, engine_spec: str
) -> None:
    """The tokens trained are the tokens sampled (the batch's ids are the prompt's plus the
    response's), and the train engine's log-probs over them, with the same pixels, equal the
    behaviour log-probs within float32 rounding; the images change what the model predicts."""
    data = write_rows(tmp_path, count=4)
    items, problems = tokenise_rows(rows_of(data), DataConfig(apply_chat_template=True), tokenizer)
    assert problems == []
    rollout = build_rollout_engine("hf", {"seed": 0}, vlm, tmp_path / "run")
    sampling = SamplingParams(n=3, max_new_tokens=5, temperature=1.0)
    groups = rollout.generate([i.prompt_ids for i in items], sampling, media=[i.media for i in items])
    samples = [s for g in groups for s in g]
    for item, group in zip(items, groups):
        for s in group:
            assert s.prompt_ids == item.prompt_ids and len(s.response_ids) >= 1
            s.media = item.media
    batch = samples_to_batch(samples, [i for i in range(len(items)) for _ in range(3)], pad_token_id=0)
    for row, s in enumerate(samples):
        assert (
            batch["input_ids"][row, : len(s.prompt_ids) + len(s.response_ids)].tolist() == s.prompt_ids + s.response_ids
        )
    engine = engine_or_skip(engine_spec, vlm)
    logprobs = engine.compute_logprobs(batch)
    mask = batch["response_mask"].bool()
    assert torch.allclose(logprobs[mask], batch["behave_logprobs"][mask], atol=1e-4), (
        (logprobs[mask] - batch["behave_logprobs"][mask]).abs().max()
    )
    # without the pixels (other images) the log-probs differ: the vision tower is in the forward
    swapped = TensorBatch(dict(batch.data))
    swapped["pixel_values"] = torch.flip(batch["pixel_values"], dims=[0])
    assert not torch.allclose(engine.compute_logprobs(swapped)[mask], logprobs[mask], atol=1e-4)

    # a train step moves the vision tower's weights too, and the weight sync carries them by HF name
    def nll(mb: TensorBatch, lp: torch.Tensor, ent: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=-lp)

    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    before = engine.full_state_dict()
    metrics = engine.train_step(batch, nll)
    after = engine.full_state_dict()
    assert metrics["nonfinite"] == 0.0
    vision = [k for k in after if k.startswith("model.visual.")]
    assert vision and any(not torch.equal(before[k], after[k]) for k in vision)
    rollout.update_weights(after, version=1)
    synced = rollout.model.state_dict()
    assert all(torch.equal(synced[k], after[k]) for k in vision)
    rollout.close()
    engine.close()


@pytest.mark.parametrize("engine_spec", ["fsdp", "deepspeed", "deepspeed-zero3"])
def test_frozen_vision_tower_keeps_its_weights(tmp_path: Path, vlm: Path, engine_spec: str) -> None:
    samples = [Sample(prompt_ids_with_image(vlm), [7, 8], [-1.0, -1.0], 0, "stop", media=tiny_media())]
    batch = samples_to_batch(samples, [0], pad_token_id=0)
    batch["loss_weight"] = batch["response_mask"] / batch["response_mask"].sum()
    # train the projector (merger), not the tower
    engine = engine_or_skip(engine_spec, vlm, lr=0.5, freeze=[r"^model\.visual\.(?!merger)"])
    before = engine.full_state_dict()
    engine.train_step(batch, lambda mb, lp, ent: LossOutput(per_token_loss=-lp))
    after = engine.full_state_dict()
    tower = [k for k in after if k.startswith("model.visual.") and ".merger." not in k]
    merger = [k for k in after if k.startswith("model.visual.merger.")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in merger)
    engine.close()


def prompt_ids_with_image(vlm: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vlm)
    text = (
        "<|im_start|>user\n<|vision_start|>"
        + IMAGE_PAD * 4
        + "<|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n"
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def tiny_media() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}


# -- validation and runs ------------------------------------------------------------------------


def grpo_config(tmp_path: Path, model: Path, data: Path, *, steps: int, **sections: object) -> Path:
    config = {
        "experiment": {"name": "vlm", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "data": {"train_files": [str(data)], "apply_chat_template": True, "batch_size": 4},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 1e-3}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match", "answer_key": "answer"},
        "trainer": {"total_steps": steps, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [],
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if key != "reward" and isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def test_config_validate_refuses_a_vlm_on_an_engine_without_multimodal(tmp_path: Path, vlm: Path, capsys) -> None:
    data = write_rows(tmp_path, count=4)
    pytest.importorskip("core_rl_megatron")
    config = grpo_config(tmp_path, vlm, data, steps=1, actor={"engine": {"name": "megatron"}})
    code = cli.main(["config", "validate", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert "actor.engine.name: train engine 'megatron'" in err and "does not take images" in err
    assert "Traceback" not in err
    assert cli.main(["config", "validate", str(grpo_config(tmp_path, vlm, data, steps=1))]) == 0


def test_core_rl_plugins_lists_the_engines_claiming_multimodal(capsys) -> None:
    assert cli.main(["plugins", "--json"]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    claims = {key: row["claims"] for key, row in rows.items() if "engine" in key[0]}
    assert "multimodal" in claims[next(k for k in claims if k[1] == "hf")]
    assert "multimodal" in claims[next(k for k in claims if k[1] == "fsdp")]
    assert "multimodal" in claims[next(k for k in claims if k[1] == "deepspeed")]
    assert "multimodal" not in claims[next(k for k in claims if k[1] == "megatron")]


def test_grpo_runs_end_to_end_on_image_rows(tmp_path: Path, vlm: Path) -> None:
    # the response's length as the reward: a random model's samples differ in it, so every step trains;
    # the rollout's behaviour log-probs and the trainer's, over the same tokens and pixels, agree
    assert two_grpo_steps_export(tmp_path, vlm) == "Qwen2VLForConditionalGeneration"
    assert (tmp_path / "runs" / "vlm" / "final_hf" / "preprocessor_config.json").is_file()  # the export is a VLM again


@pytest.mark.parametrize("engine", TRAIN_ENGINES)
def test_grpo_on_image_rows_resumes_bitwise(tmp_path: Path, vlm: Path, engine: str) -> None:
    """Three synchronous steps at once, and one step, a checkpoint, then a resume to three: the same
    metrics and bitwise the same weights and optimizer state (the images are read and encoded again
    on resume, the data position and every RNG come from the checkpoint). Eight rows of four a step:
    step 3 starts the second epoch, so the resumed run also reshuffles as the whole one does."""
    from core_rl.testing.faults import checkpoint, stable_metrics, state_digest
    from core_rl.testing.launch import run_train

    pytest.importorskip(f"core_rl_{engine}")
    data = write_rows(tmp_path, count=8)
    length = {"name": "function", "path": f"{REWARDS}:scaled_length", "kwargs": {"scale": 1.0}}
    config = grpo_config(tmp_path, vlm, data, steps=3, reward=length, actor={"engine": {"name": engine}})
    runs = tmp_path / "runs"
    run_train(config, "experiment.name=whole", "saver.at_end=true")
    run_train(config, "experiment.name=part", "trainer.total_steps=1", "saver.at_end=true")
    run_train(config, "experiment.name=part", "saver.at_end=true", "recover.mode=resume")
    whole, part = stable_metrics(runs / "whole"), stable_metrics(runs / "part")
    assert sorted(whole) == [1, 2, 3] and all(whole[step]["actor/tokens"] > 0 for step in whole)
    assert whole == part
    digest = state_digest(checkpoint(runs / "whole", 3))
    assert {"model.safetensors", "optimizer.safetensors"} <= digest.keys()
    assert digest == state_digest(checkpoint(runs / "part", 3))


@pytest.mark.parametrize("engine", TRAIN_ENGINES)
def test_grpo_with_lora_on_image_rows_adapts_the_language_model_only(tmp_path: Path, vlm: Path, engine: str) -> None:
    """``actor.lora`` (all-linear) on a VLM: adapters on the language model's linear layers only, the
    vision tower and projector without any and frozen (the export's equal the base model's); the
    merged weight sync reaches the rollout engine (its log-probs equal the trainer's at step 2), and
    the adapter alone is exported with language-model names only."""
    from core_rl.builtin import read_metrics
    from safetensors.torch import load_file

    pytest.importorskip(f"core_rl_{engine}")
    data = write_rows(tmp_path, count=8)
    length = {"name": "function", "path": f"{REWARDS}:scaled_length", "kwargs": {"scale": 1.0}}
    actor = {"engine": {"name": engine}, "lora": {"rank": 4, "alpha": 8}, "optimizer": {"name": "adamw", "lr": 1e-2}}
    assert cli.main(["train", str(grpo_config(tmp_path, vlm, data, steps=2, reward=length, actor=actor))]) == 0
    rows = [r for r in read_metrics(tmp_path / "runs" / "vlm" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["actor/nonfinite"] == 0 for r in rows)
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in rows)
    export = tmp_path / "runs" / "vlm" / "final_hf"
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".language_model." in k for k in adapter), sorted(adapter)[:4]
    adapted = json.loads((export / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert adapted and not any("visual" in name for name in adapted)
    # the files keep Qwen2-VL's checkpoint names: visual.* (tower and merger), model.layers.* (language model)
    base, merged = load_file(vlm / "model.safetensors"), load_file(export / "model.safetensors")
    vision = [k for k in base if k.startswith("visual.")]
    assert vision and all(torch.equal(base[k], merged[k]) for k in vision)
    assert any(not torch.equal(base[k], merged[k]) for k in base if k.startswith("model.layers."))


def test_lora_targets_of_a_vlm_are_its_language_models_modules(tmp_path: Path, vlm: Path, capsys) -> None:
    """Named targets match the language model's modules only; a target that only the vision tower
    has (Qwen2-VL's ``qkv``) is refused before a run (the preflight, exit 2), naming the key; a text
    model is left to peft as before."""
    from core_rl.roles.lora import language_model_targets
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm)
    assert language_model_targets(model, ["q_proj", "fc1"]) == [
        f"model.language_model.layers.{i}.self_attn.q_proj" for i in range(2)
    ]
    text = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "text", alphabet="ab"))
    assert language_model_targets(text, ["all-linear"]) is None
    data = write_rows(tmp_path, count=4)
    config = grpo_config(tmp_path, vlm, data, steps=1, actor={"lora": {"rank": 4, "target_modules": ["qkv"]}})
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "actor.lora.target_modules: ['qkv']: no module of the language model (model.language_model) matches" in err


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_supervised_loops_train_on_image_rows(tmp_path: Path, vlm: Path, algorithm: str) -> None:
    from core_rl.builtin import read_metrics

    data = write_rows(tmp_path, count=8, key="response" if algorithm == "sft" else "chosen")
    config = {
        "experiment": {"name": algorithm, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "data": {"train_files": [str(data)], "apply_chat_template": True, "batch_size": 4},
        "actor": {"model_path": str(vlm), "optimizer": {"name": "adamw", "lr": 1e-3}},
        "algorithm": {"name": algorithm},
        "trainer": {"total_steps": 2, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [],
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    assert cli.main(["train", str(path)]) == 0
    rows = read_metrics(tmp_path / "runs" / algorithm / "metrics.jsonl")
    losses = [r[f"{algorithm}/loss"] for r in rows if f"{algorithm}/loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)


@pytest.fixture(scope="module")
def conformance_samples(tmp_path_factory: pytest.TempPathFactory, vlm: Path) -> list[Sample]:
    """The rollout half of the conformance case, passed by ``hf`` (its samples, for the train half)."""
    from core_rl.testing.multimodal_contracts import check_multimodal_rollout

    rollout = build_rollout_engine("hf", {"seed": 1}, vlm, tmp_path_factory.mktemp("conformance") / "run")
    samples = check_multimodal_rollout(rollout, vlm)
    rollout.close()
    return samples


@pytest.mark.parametrize("engine_spec", ["fsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"])
def test_the_train_engines_pass_the_multimodal_conformance_case(
    vlm: Path, conformance_samples: list[Sample], engine_spec: str
) -> None:
    """``hf`` passes the rollout half (the fixture); each train engine claiming ``multimodal`` (every
    ZeRO stage of ``deepspeed``) the train half."""
    from core_rl.testing.multimodal_contracts import check_multimodal_train

    engine = engine_or_skip(engine_spec, vlm)
    check_multimodal_train(engine, vlm, conformance_samples)
    engine.close()


@pytest.mark.parametrize("engine", TRAIN_ENGINES)
def test_grpo_on_image_rows_runs_on_two_ranks(tmp_path: Path, vlm: Path, engine: str) -> None:
    """Two CPU ranks, each with its share of the rows and their images (gloo)."""
    from core_rl.builtin import read_metrics
    from core_rl.testing.launch import run_train

    pytest.importorskip(f"core_rl_{engine}")
    data = write_rows(tmp_path, count=8)
    length = {"name": "function", "path": f"{REWARDS}:scaled_length", "kwargs": {"scale": 1.0}}
    actor = {"engine": {"name": engine}}
    config = grpo_config(tmp_path, vlm, data, steps=2, reward=length, actor=actor)
    run_train(config, nproc=2, cpu=True, timeout=300)
    rows = [r for r in read_metrics(tmp_path / "runs" / "vlm" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["actor/nonfinite"] == 0 for r in rows)
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in rows)


@pytest.mark.parametrize(
    ("family", "engine_spec"),
    [("vlm", "fsdp"), ("vlm", "deepspeed"), ("vlm", "deepspeed-zero3"), ("llava", "fsdp")],
)
def test_two_ranks_line_up_when_only_one_has_images(
    tmp_path: Path, request: pytest.FixtureRequest, family: str, engine_spec: str
) -> None:
    """Rank 0's rows are text only, rank 1's hold an image: rank 0 runs the vision tower over a blank
    image inside its forward (a zero term), so the sharded tower's collectives (FSDP's, ZeRO-3's
    parameter gathers, ZeRO's gradient reductions) line up; rank 0's log-probs equal a one-rank
    forward of its row (the blank image changes no value). Qwen2-VL's tower takes patch rows and a
    grid, LLaVA's (CLIP) whole images."""
    pytest.importorskip(f"core_rl_{engine_spec.partition('-zero')[0]}")
    from core_rl.testing.launch import run_torchrun
    from core_rl.testing.multimodal_contracts import image_prompts

    vlm = request.getfixturevalue(family)
    prompts, media = image_prompts(vlm)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"prompt": prompts[0], **{k: v.tolist() for k, v in media[0].items()}}))
    worker = Path(__file__).with_name("vlm_ranks_worker.py")
    run_torchrun(worker, 2, str(vlm), str(tmp_path), str(spec), engine_spec)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    alone = samples_to_batch([Sample([1, 9, 10, 11], [7, 8], [-1.0, -1.0], 0, "stop")], [0], pad_token_id=0)
    engine = train_engine("fsdp", vlm)
    assert torch.allclose(torch.tensor(rank0["logprobs"]), engine.compute_logprobs(alone)[0], atol=1e-5)
    engine.close()


def test_hf_agenerate_with_images_batches_requests_and_keeps_each_prompts_pixels(tmp_path: Path, vlm: Path) -> None:
    """Requests in flight together are generated as one batch; each is answered from its own image
    (the samples' log-probs equal those of generating each prompt alone, greedily)."""
    import asyncio

    from core_rl.testing.multimodal_contracts import image_prompts

    prompts, media = image_prompts(vlm)
    engine = build_rollout_engine("hf", {"seed": 0}, vlm, tmp_path / "run")
    greedy = SamplingParams(n=1, max_new_tokens=3, greedy=True)

    async def both() -> list[list[Sample]]:
        calls = [engine.agenerate(p, greedy, **({"media": m} if m is not None else {})) for p, m in zip(prompts, media)]
        return list(await asyncio.gather(*calls))

    together = asyncio.run(both())
    for prompt, pixels, (sample,) in zip(prompts, media, together):
        ((alone,),) = engine.generate([prompt], greedy, media=[pixels])
        assert sample.response_ids == alone.response_ids
        assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    engine.close()


# -- a second family: LLaVA ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny_vlm import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "model", words=[*COLOURS, "colour?"], seed=0)


def test_llava_rows_take_whole_images_and_image_seq_length_placeholders(tmp_path: Path, llava: Path) -> None:
    """LLaVA's processor gives whole images (``pixel_values`` ``[images, 3, H, W]``), and each
    ``<image>`` is repeated to the config's ``image_seq_length`` ((16 / 4)**2 patches, CLS dropped);
    core-rl's ``(1, 1, 1)`` grid keeps the image with its row and never reaches the model."""
    from core_rl.testing.tiny_vlm import LLAVA_IMAGE
    from core_rl.vision.media import forward_kwargs
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llava)
    items, problems = tokenise_rows(
        rows_of(write_rows(tmp_path, count=2)), DataConfig(apply_chat_template=True), tokenizer
    )
    assert problems == []
    assert items[0].prompt_ids.count(tokenizer.convert_tokens_to_ids(LLAVA_IMAGE)) == 16
    assert items[0].media["pixel_values"].shape == (1, 3, 16, 16)
    assert items[0].media["image_grid_thw"].tolist() == [[1, 1, 1]]
    batch = samples_to_batch(
        [Sample(i.prompt_ids, [5], [-1.0], 0, "stop", media=i.media) for i in items], [0, 1], pad_token_id=0
    )
    assert batch["pixel_values"].shape == (2, 1, 3, 16, 16)
    pixels = row_media(batch, [1])
    assert torch.equal(pixels["pixel_values"], items[1].media["pixel_values"])
    model = AutoModelForImageTextToText.from_pretrained(llava)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert set(forward_kwargs(model, batch["input_ids"], pixels)) == {"pixel_values"}


@pytest.mark.parametrize("engine_spec", ["fsdp", "deepspeed", "deepspeed-zero3"])
def test_llava_passes_the_multimodal_conformance_case(tmp_path: Path, llava: Path, engine_spec: str) -> None:
    """``hf`` samples the tiny LLaVA with images (log-probs of a transformers forward, no placeholder
    sampled) and the train engine computes the same log-probs."""
    hf_and_train_engine_conform(tmp_path, llava, engine_spec)


def hf_and_train_engine_conform(tmp_path: Path, model: Path, engine_spec: str) -> None:
    """The conformance case on ``model``: ``hf`` samples it with images and the train engine
    ``engine_spec`` computes the same log-probs (:mod:`core_rl.testing.multimodal_contracts`)."""
    from core_rl.testing.multimodal_contracts import check_multimodal_rollout, check_multimodal_train

    rollout = build_rollout_engine("hf", {"seed": 1}, model, tmp_path / "run")
    samples = check_multimodal_rollout(rollout, model)
    rollout.close()
    engine = engine_or_skip(engine_spec, model)
    check_multimodal_train(engine, model, samples)
    engine.close()


def test_llava_samples_prompts_with_two_images(tmp_path: Path, llava: Path) -> None:
    """A prompt with two images beside one with one, two samples each: every behaviour log-prob
    is a transformers forward's of the same ids and images (each image in its own placeholders)."""
    from core_rl.testing.multimodal_contracts import reference_logprobs
    from core_rl.vision.prompts import encode_vision_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llava)
    prompts, media = [], []
    for colours in (["red", "blue"], ["green"]):
        row = {"images": [square(c) for c in colours]}
        ids, _, pixels = encode_vision_prompt(
            row, "colour?", tokenizer, image_key="images", max_images=2, system_prompt=None, template_kwargs={}
        )
        prompts.append(ids)
        media.append(pixels)
    assert media[0]["pixel_values"].shape == (2, 3, 16, 16)
    rollout = build_rollout_engine("hf", {"seed": 1}, llava, tmp_path / "run")
    groups = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4, temperature=1.0), media=media)
    rollout.close()
    samples = []
    for pixels, group in zip(media, groups):
        for s in group:
            s.media = pixels
            samples.append(s)
    for s, expected in zip(samples, reference_logprobs(llava, samples)):
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4)


def test_grpo_runs_on_image_rows_with_llava(tmp_path: Path, llava: Path) -> None:
    assert two_grpo_steps_export(tmp_path, llava) == "LlavaForConditionalGeneration"


def two_grpo_steps_export(tmp_path: Path, model: Path) -> str:
    """Two GRPO steps on image rows of ``model`` (a length reward): every step trains on finite
    values with the rollout's log-probs within 1e-4 of the trainer's; the class name of the
    exported model as it reloads."""
    from core_rl.builtin import read_metrics
    from transformers import AutoModelForImageTextToText

    data = write_rows(tmp_path, count=8)
    length = {"name": "function", "path": f"{REWARDS}:scaled_length", "kwargs": {"scale": 1.0}}
    assert cli.main(["train", str(grpo_config(tmp_path, model, data, steps=2, reward=length))]) == 0
    rows = [r for r in read_metrics(tmp_path / "runs" / "vlm" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 2 and all(r["actor/tokens"] > 0 and r["actor/nonfinite"] == 0 for r in rows)
    assert all(r["mismatch/abs_logprob_diff"] < 1e-4 for r in rows)
    return type(AutoModelForImageTextToText.from_pretrained(tmp_path / "runs" / "vlm" / "final_hf")).__name__


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of Qwen2.5-VL's layout (a windowed tower) and of Qwen3-VL's (learnt position
    embeddings, deep-stack features, a Qwen3 language model with interleaved M-RoPE)."""
    family = request.param
    return build_tiny_vlm(tmp_path_factory.mktemp(family) / "model", words=[*COLOURS, "colour?"], seed=0, family=family)


@pytest.mark.parametrize("engine_spec", ["fsdp", "deepspeed"])
def test_qwen_vl_families_pass_the_multimodal_conformance_case(
    tmp_path: Path, qwen_family: Path, engine_spec: str
) -> None:
    """``hf`` samples each family with images (log-probs of a transformers forward, no placeholder
    sampled) and the train engine computes the same log-probs."""
    hf_and_train_engine_conform(tmp_path, qwen_family, engine_spec)


def test_grpo_runs_on_image_rows_with_each_qwen_vl_family(tmp_path: Path, qwen_family: Path) -> None:
    from transformers import AutoConfig

    assert two_grpo_steps_export(tmp_path, qwen_family) == AutoConfig.from_pretrained(qwen_family).architectures[0]
