"""Shared by the tests that train the real model (SmolLM2-135M-Instruct, the ``real_model`` fixture)
through ``core-rl train`` and check what the runs report against the model itself
(``tests/test_real_model_capabilities.py``, ``tests/test_real_model_servers.py``): the two-digit
addition task and its pairs, a short run's config and launch, and the model's log-probs recomputed
in the test's process with transformers."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.launch import run_train

REWARDS = Path(__file__).with_name("reward_functions.py")
STEPS = 2


# -- data --------------------------------------------------------------------------------------


def addition_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` two-digit additions: ``prompt``, ``answer`` (the sum) and ``wrong`` (the sum
    off by 1 to 9)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(
            {
                "prompt": f"What is {a} + {b}? Answer with the number only.",
                "answer": str(a + b),
                "wrong": str(a + b + rng.choice([-1, 1]) * rng.randint(1, 9)),
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_tasks(root: Path) -> dict[str, Any]:
    """Under ``root``: ``add`` (16 rows: prompt, answer), ``pairs`` and ``sft`` (4 rows each: a step's
    whole batch, so every step trains on the same rows): prompt/chosen/rejected and prompt/response;
    ``pair_rows`` and ``sft_rows`` hold those rows."""
    rows = addition_rows(16)
    few = rows[:4]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["wrong"]} for r in few]
    sft = [{"prompt": r["prompt"], "response": r["answer"]} for r in few]
    return {
        "add": write_jsonl(root / "add.jsonl", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
        "pairs": write_jsonl(root / "pairs.jsonl", pairs),
        "pair_rows": pairs,
        "sft": write_jsonl(root / "sft.jsonl", sft),
        "sft_rows": sft,
    }


# -- runs --------------------------------------------------------------------------------------


def train(
    tmp_path: Path,
    name: str,
    sections: dict[str, Any],
    *,
    steps: int = STEPS,
    checkpoint: bool = False,
    export: bool = False,
) -> tuple[Path, list[dict]]:
    """``core-rl train`` of ``sections`` (plus an experiment and ``trainer`` of ``steps`` steps, one
    torch thread) on the CPU, saving a checkpoint and a Hugging Face export at the end only where
    asked (each costs seconds); the run directory and its metrics, one row per step."""
    config = {
        "experiment": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 1},
        **sections,
    }
    config["saver"] = {"at_end": checkpoint, "export_hf": export, **config.get("saver", {})}
    config["trainer"] = {"total_steps": steps, "torch_threads": 1, **config.get("trainer", {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_train(path, cpu=True, timeout=900)
    run = tmp_path / "runs" / name
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["actor/nonfinite"] == 0.0 and math.isfinite(row["actor/loss"]), row
    # the figures of docs/real-models.md: each step's time, the run's own peak-memory line
    peak = re.search(r"peak memory: (.*)", proc.stdout + proc.stderr)
    times = ", ".join(f"{r['timing/step_s']:.1f}" for r in rows)
    print(f"{name}: step_s {times}; peak memory {peak[1] if peak else '?'}")
    return run, rows


def rl_sections(model: Path, data: dict[str, Any], lr: float = 1e-5, **extra: Any) -> dict[str, Any]:
    """GRPO on the addition prompts: 2 prompts x 2 samples of at most 8 new tokens, the chat template,
    the digits' share of each response as the reward (``tests/reward_functions.py``: it differs
    between samples, so the updates are not zero)."""
    sections = {
        "data": {"train_files": [str(data["add"])], "batch_size": 2, "apply_chat_template": True},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": lr}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 8, "temperature": 1.0}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "function", "path": f"{REWARDS}:digit_fraction"},
    }
    for key, value in extra.items():
        sections[key] = {**sections.get(key, {}), **value}
    return sections


# -- the model, here -------------------------------------------------------------------------


def load_model(path: Path) -> dict[str, Any]:
    """The tokenizer and the (float32, eval) causal LM of ``path`` in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {"tokenizer": AutoTokenizer.from_pretrained(path), "model": model}


def chat_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as the runs render it: the model's chat template, one user turn, the assistant's
    turn opened."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def response_ids(tokenizer: Any, text: str, *, eos: bool) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.eos_token_id] if eos else ids


def response_logprobs(model: Any, prompt: list[int], response: list[int]) -> Any:
    """Per-token log-probs of ``response`` after ``prompt`` under ``model``."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def k3_kl(logp: Any, ref_logp: Any) -> float:
    """The token mean of the k3 estimate of KL(p || ref) from log-probs of tokens sampled from ``p``
    (``exp(d) - 1 - d``, ``d = ref_logp - logp``), as ``offpolicy/kl_behave_old`` reports it."""
    d = ref_logp - logp
    return float((d.exp() - 1 - d).mean())


def dumped_samples(run: Path, step: int) -> list[dict[str, Any]]:
    """Step ``step``'s samples as ``rollout.dump`` saved them (prompt and response ids, behaviour
    log-probs, ...; :mod:`core_rl.rollout.dump`)."""
    import pyarrow.parquet as pq

    return pq.read_table(run / "rollouts" / f"step_{step:08d}.parquet").to_pylist()
