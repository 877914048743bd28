"""The real pretrained model (SmolLM2-135M-Instruct: BPE vocabulary, ChatML template, output head tied
to the embedding; ``real_model`` fixture) trains with GRPO, checkpoints at every step and resumes
bit for bit: ``fsdp`` on one rank and on two, ``deepspeed`` ZeRO-3.

A run of two steps saves after each; a copy of its directory cut back to the first checkpoint is
resumed (``recover.mode: resume``) and must end with the same bytes in every file of its second
checkpoint (weights, optimizer state, RNG states, data position) and in its final export. A model
with tied embeddings once crashed at its first checkpoint, after the training it was meant to keep."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import yaml
from core_rl.testing.launch import run_train

STEPS = 2
REWARDS = Path(__file__).with_name("reward_functions.py")


def write_addition_task(path: Path, count: int = 16, seed: int = 0) -> Path:
    """``count`` rows of two-digit addition, ``prompt`` and ``answer``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def real_grpo_config(tmp_path: Path, model: Path, engine: dict) -> Path:
    """GRPO on the real model: 2 prompts x 2 samples of at most 8 new tokens, the chat template,
    the digits' share of the response as the reward (``tests/reward_functions.py``: it differs
    between samples, so the update is not zero), a checkpoint after every step."""
    config = {
        "experiment": {"name": "straight", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "data": {
            "train_files": [str(write_addition_task(tmp_path / "train.jsonl"))],
            "batch_size": 2,
            "apply_chat_template": True,
        },
        "actor": {"model_path": str(model), "engine": engine, "optimizer": {"name": "adamw", "lr": 1e-5}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 8, "temperature": 1.0}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "function", "path": f"{REWARDS}:digit_fraction"},
        "trainer": {"total_steps": STEPS, "torch_threads": 1},
        "saver": {"every_n_steps": 1, "keep_last": STEPS},
    }
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cut_back_to_first_checkpoint(run: Path, copy: Path) -> None:
    """``copy``: ``run``'s directory as it was after its first checkpoint (the later checkpoint and the
    export left out; the metrics beyond are the resume's to drop). The first checkpoint's files are
    hard links (1.6 GB not written again: the resume reads them, and nothing reads ``run``'s copy
    of them afterwards); the rest is copied."""
    later = {p.name for p in sorted((run / "checkpoints").glob("step_*"))[1:]}

    def leave_out(directory: str, names: list[str]) -> set[str]:
        if Path(directory) == run:
            return {"final_hf"} & set(names)
        return later & set(names) if Path(directory) == run / "checkpoints" else set()

    def link_checkpoint_files(src: str, dst: str) -> None:
        if any(parent.parent == run / "checkpoints" for parent in Path(src).parents):  # in a step_* directory
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(run, copy, ignore=leave_out, copy_function=link_checkpoint_files)
    assert sorted(p.name for p in (copy / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert not (copy / "final_hf").exists()
    (copy / "checkpoints" / "latest").write_text("step_00000001")


def assert_same_bytes(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between {a} and {b}"


def check_resume(tmp_path: Path, model: Path, engine: dict, nproc: int = 0) -> None:
    config = real_grpo_config(tmp_path, model, engine)
    run_train(config, nproc=nproc, cpu=True, timeout=900)
    runs = tmp_path / "runs"
    straight = runs / "straight"
    checkpoints = sorted((straight / "checkpoints").glob("step_*"))
    assert [p.name for p in checkpoints] == ["step_00000001", "step_00000002"]
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and any(m["actor/grad_norm"] > 0 for m in metrics)

    cut_back_to_first_checkpoint(straight, runs / "resumed")
    run_train(config, "experiment.name=resumed", "recover.mode=resume", nproc=nproc, cpu=True, timeout=900)
    assert_same_bytes(checkpoints[-1], runs / "resumed" / "checkpoints" / "step_00000002")
    assert_same_bytes(straight / "final_hf", runs / "resumed" / "final_hf")
    check_tied_export(straight / "final_hf", checkpoints[-1])


def check_tied_export(export: Path, checkpoint: Path) -> None:
    """The export reloads with its head tied, holding the trained embedding of the checkpoint."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    saved = load_file(str(checkpoint / "model.safetensors"))
    embedding = next(v for k, v in saved.items() if k.endswith("embed_tokens.weight"))
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_fsdp_one_rank(tmp_path: Path, real_model: Path) -> None:
    check_resume(tmp_path, real_model, {"name": "fsdp"})


def test_fsdp_two_ranks(tmp_path: Path, real_model: Path) -> None:
    check_resume(tmp_path, real_model, {"name": "fsdp"}, nproc=2)


@pytest.mark.parametrize("ranks", [1])
def test_deepspeed_zero3(tmp_path: Path, real_model: Path, ranks: int) -> None:
    pytest.importorskip("core_rl_deepspeed")
    check_resume(tmp_path, real_model, {"name": "deepspeed", "zero_stage": 3}, nproc=ranks if ranks > 1 else 0)
