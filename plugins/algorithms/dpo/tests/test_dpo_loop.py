"""The ``dpo`` loop end to end through ``core-rl train`` with the real ``fsdp`` engine on a tiny
model (CPU): implicit-reward accuracy rises, an interrupted run resumes to bitwise-equal weights,
2 ranks match 1 rank, the precomputed-reference path agrees with the reference model, and a
missing column is a clear error."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.tiny import build_tiny_model
from safetensors.torch import load_file

pytest.importorskip("core_rl_fsdp")

STRINGS = ["".join(p) for n in (2, 3) for p in itertools.product("abcd", repeat=n) if "".join(p) != "".join(p)[::-1]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "pairs.jsonl"
    # prefer the reversed string over the string itself: separable, learnable from the prompt
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "chosen": s[::-1], "rejected": s}) + "\n" for s in STRINGS))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 5},
        "data": {"train_files": [str(data)], "batch_size": 8},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 5e-3}},
        "algorithm": {"name": "dpo"},
        "trainer": {"total_steps": 8, "torch_threads": 1, "loop": {"beta": 0.5}},
        "saver": {"every_n_steps": 4, "keep_last": 1},
        "loggers": [{"name": "console"}],
    }
    path = root / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "data": data, "model": model}


def train(config: Path, *overrides: str, nproc: int = 0, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "core_rl.cli"]
    if nproc:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]
        cmd += ["-m", "core_rl.cli"]
    proc = subprocess.run(
        [*cmd, "train", str(config), *overrides], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def weights(run: Path) -> dict:
    return load_file(run / "final_hf" / "model.safetensors")


def test_accuracy_rises_and_resume_is_exact(setup):
    runs = setup["root"] / "runs"
    train(setup["config"], "experiment.name=straight")
    rows = read_metrics(runs / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    for key in ("dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin", "dpo/logps/chosen", "actor/grad_norm"):
        assert key in rows[0], key
    # policy == reference before the first update: log-ratios 0, loss log 2, no pair ranked right yet
    assert rows[0]["dpo/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert rows[0]["dpo/rewards/accuracy"] == 0.0
    assert min(r["dpo/rewards/accuracy"] for r in rows[-3:]) >= 0.875
    assert rows[-1]["dpo/loss"] < 0.5 * rows[0]["dpo/loss"]
    # stopped after step 4 (a run of 4 steps), then resumed to 8: the same weights, bit for bit
    train(setup["config"], "experiment.name=resumed", "trainer.total_steps=4")
    train(setup["config"], "experiment.name=resumed", "recover.mode=auto")
    a, b = weights(runs / "straight"), weights(runs / "resumed")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    resumed = read_metrics(runs / "resumed" / "metrics.jsonl")
    assert [r["dpo/loss"] for r in resumed] == [r["dpo/loss"] for r in rows]


def test_two_ranks_match_one_rank(setup):
    runs = setup["root"] / "runs"
    common = ("trainer.total_steps=2", "saver.every_n_steps=0", "trainer.loop.loss_type=hinge")
    train(setup["config"], "experiment.name=one", *common, nproc=1)
    train(setup["config"], "experiment.name=two", *common, nproc=2)
    one, two = read_metrics(runs / "one" / "metrics.jsonl"), read_metrics(runs / "two" / "metrics.jsonl")
    for a, b in zip(one, two, strict=True):
        for key in ("dpo/loss", "dpo/rewards/margin", "dpo/logps/chosen", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    wa, wb = weights(runs / "one"), weights(runs / "two")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 5e-5


def test_precomputed_reference_matches_the_reference_model(setup, tmp_path):
    """Rows carrying the reference model's own sequence log-probs train exactly as the model reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(setup["model"])
    model = AutoModelForCausalLM.from_pretrained(setup["model"]).eval()

    def seq_logprob(prompt: str, response: str) -> float:
        p = tok(prompt)["input_ids"]
        r = [*tok(response, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        return float(logp[len(p) - 1 :].sum())

    rows = [json.loads(line) for line in setup["data"].read_text().splitlines()]
    data = tmp_path / "pre.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    **r,
                    "ref_chosen_logp": seq_logprob(r["prompt"], r["chosen"]),
                    "ref_rejected_logp": seq_logprob(r["prompt"], r["rejected"]),
                }
            )
            + "\n"
            for r in rows
        )
    )
    runs = setup["root"] / "runs"
    common = ("trainer.total_steps=2", "saver.every_n_steps=0")
    train(setup["config"], "experiment.name=model_ref", *common)
    train(
        setup["config"],
        "experiment.name=pre_ref",
        *common,
        f"data.train_files=[{data}]",
        "trainer.loop.reference=precomputed",
    )
    a, b = read_metrics(runs / "model_ref" / "metrics.jsonl"), read_metrics(runs / "pre_ref" / "metrics.jsonl")
    for x, y in zip(a, b, strict=True):
        for key in ("dpo/loss", "dpo/rewards/margin"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), key
    # the original rows have no such columns: one clear error, exit status 2
    bad = train(setup["config"], "experiment.name=bad", *common, "trainer.loop.reference=precomputed", expect=2)
    assert "ref_chosen_logp" in bad.stderr and "Traceback" not in bad.stderr
