"""The ``rm`` loop end to end through ``core-rl train`` with the real ``fsdp`` engine on a tiny
model (CPU): on a separable preference set the held-out pairwise accuracy passes 0.9, an
interrupted run resumes to bitwise-equal weights, and the exported model, loaded by the
``reward_model`` reward, gives the trained engine's scores and ranks the held-out pairs as the
loop's own evaluation did."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.launch import run_train as train
from core_rl.testing.tiny import build_tiny_model
from safetensors.torch import load_file

pytest.importorskip("core_rl_fsdp")

STRINGS = ["".join(p) for n in (2, 3, 4) for p in itertools.product("abc", repeat=n)]


def pair(s: str, rng: random.Random) -> dict:
    """Chosen: the reversal; rejected: the reversal with one letter replaced by ``d`` (which no
    prompt or chosen response holds): separable, but only by looking through the response."""
    rejected = list(s[::-1])
    rejected[rng.randrange(len(s))] = "d"
    return {"prompt": f"{s}=", "chosen": s[::-1], "rejected": "".join(rejected)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    rng = random.Random(0)
    rows = [pair(s, rng) for s in STRINGS]
    rng.shuffle(rows)
    train_rows, val_rows = rows[:-24], rows[-24:]  # held-out prompts never trained on
    for name, part in (("train", train_rows), ("val", val_rows)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(root / "train.jsonl")], "batch_size": 16},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 3e-3}},
        "algorithm": {"name": "rm"},
        "trainer": {"total_steps": 12, "torch_threads": 1, "loop": {"val_files": [str(root / "val.jsonl")]}},
        "saver": {"every_n_steps": 6, "keep_last": 1},
        "loggers": [{"name": "console"}],
    }
    path = root / "rm.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "model": model, "val": root / "val.jsonl"}


@pytest.fixture(scope="module")
def straight(setup) -> Path:
    train(setup["config"], "experiment.name=straight")
    return setup["root"] / "runs" / "straight"


def test_held_out_accuracy_passes_the_bar_and_resume_is_exact(setup, straight):
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("rm/loss", "rm/accuracy", "rm/scores/chosen", "rm/scores/rejected", "rm/scores/margin"):
        assert key in rows[0], key
    # the score head starts at zero: every score 0, loss log 2, no pair ranked right (strict >)
    assert rows[0]["rm/loss"] == pytest.approx(0.693147, abs=1e-6)
    assert rows[0]["rm/accuracy"] == 0.0 and rows[0]["rm/scores/chosen"] == 0.0
    for r in rows:
        assert r["rm/scores/margin"] == pytest.approx(r["rm/scores/chosen"] - r["rm/scores/rejected"], abs=1e-5)
    # evaluated after the last step only (eval_every_n_steps 0), on the 24 held-out pairs
    assert [r["step"] for r in rows if "rm/val/accuracy" in r] == [12]
    assert rows[-1]["rm/val/accuracy"] > 0.9, rows[-1]
    assert rows[-1]["rm/loss"] < 0.5 * rows[0]["rm/loss"]
    # stopped after step 6 (a run of 6 steps), then resumed to 12: the same weights, bit for bit
    runs = setup["root"] / "runs"
    train(setup["config"], "experiment.name=resumed", "trainer.total_steps=6")
    train(setup["config"], "experiment.name=resumed", "recover.mode=auto")
    a, b = (load_file(run / "final_hf" / "model.safetensors") for run in (straight, runs / "resumed"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    resumed = read_metrics(runs / "resumed" / "metrics.jsonl")
    assert [r["rm/loss"] for r in resumed] == [r["rm/loss"] for r in rows]


def test_export_is_served_by_the_reward_model_reward_with_the_trained_scores(setup, straight):
    pytest.importorskip("core_rl_reward_model")
    from core_rl.config.loader import structure
    from core_rl.config.schema import ActorConfig
    from core_rl.testing import make_reward_input
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_reward_model.config import RewardModelConfig
    from core_rl_reward_model.reward import ModelReward
    from core_rl_rm.loop import score_batch
    from transformers import AutoConfig, AutoTokenizer

    export = straight / "final_hf"
    config = AutoConfig.from_pretrained(export)
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    weights = load_file(export / "model.safetensors")
    assert "score.weight" in weights and "score.bias" not in weights and "lm_head.weight" not in weights

    # the trained engine: the run's last checkpoint (not the export) loaded into a score-head engine
    engine = FSDPEngine(ActorConfig(model_path=str(setup["model"])), head="score")
    engine.load_state(straight / "checkpoints" / "step_00000012")
    assert torch.equal(engine.full_state_dict()["score.weight"], weights["score.weight"])
    tok = AutoTokenizer.from_pretrained(setup["model"])
    pairs = [json.loads(line) for line in setup["val"].read_text().splitlines()]
    prompts = [tok(p["prompt"])["input_ids"] for p in pairs] * 2
    responses = [tok(p[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected") for p in pairs]
    batch = score_batch(prompts, responses, tok.pad_token_id)
    trained = (engine.compute_values(batch) * batch["score_mask"]).sum(1)
    engine.close()

    reward = ModelReward(structure({"model_path": str(export), "batch_size": 7}, RewardModelConfig, path="reward"))
    items = [make_reward_input(p[k], prompt=p["prompt"]) for k in ("chosen", "rejected") for p in pairs]
    served = torch.tensor(reward.score(items))
    assert served.abs().max() > 0.1  # trained, not the zero head
    torch.testing.assert_close(served, trained, atol=2e-5, rtol=1e-5)
    n = len(pairs)
    accuracy = float((served[:n] > served[n:]).float().mean())
    assert accuracy > 0.9
    assert accuracy == read_metrics(straight / "metrics.jsonl")[-1]["rm/val/accuracy"]


def test_margin_and_label_smoothing_reach_the_loss(setup, tmp_path):
    # every score is 0 at the first step, so with margin m = 1 and eps = 0.1 each pair's loss is
    # 0.9 log(1 + e^1) + 0.1 log(1 + e^-1) = 0.9 * 1.313262 + 0.1 * 0.313262 = 1.213262 (centering adds 0)
    rows = [{**json.loads(line), "m": 1.0} for line in (setup["root"] / "train.jsonl").read_text().splitlines()]
    data = tmp_path / "margins.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(
        setup["config"],
        "experiment.name=options",
        f"experiment.output_dir={tmp_path}",
        f"data.train_files=[{data}]",
        "trainer.total_steps=1",
        "saver.every_n_steps=0",
        "trainer.loop.margin_key=m",
        "trainer.loop.label_smoothing=0.1",
        "trainer.loop.center_coef=0.5",
        "trainer.loop.val_files=[]",
    )
    (first,) = read_metrics(tmp_path / "options" / "metrics.jsonl")
    assert first["rm/loss"] == pytest.approx(1.213262, abs=1e-5)


def test_score_batch_puts_the_slot_after_the_last_token() -> None:
    from core_rl_rm.loop import score_batch

    batch = score_batch([[1, 5], [1]], [[6, 7], []], pad_token_id=0)
    # rows [1 5 6 7 slot], [1 slot 0 0 0]: the slot (pad id, attended) scores the token before it
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 0], [1, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["score_mask"].tolist() == [[0, 0, 0, 0, 1], [0, 1, 0, 0, 0]]


def test_a_missing_margin_is_one_clear_error() -> None:
    from core_rl.data.prompts import PromptItem
    from core_rl.errors import DataError
    from core_rl_rm.config import RMConfig
    from core_rl_rm.loop import RMLoop

    loop = RMLoop.__new__(RMLoop)  # margin() reads only the loop's own section
    loop.loop_config = RMConfig(margin_key="m")
    assert loop.margin(PromptItem(row={"m": 1.5}, text="ab=", prompt_ids=[1])) == 1.5
    with pytest.raises(DataError, match="margin_key is 'm'.*got 'x'"):
        loop.margin(PromptItem(row={"m": "x"}, text="ab=", prompt_ids=[1]))
    loop.loop_config = RMConfig()
    assert loop.margin(PromptItem(row={}, text="ab=", prompt_ids=[1])) == 0.0


def test_an_engine_without_a_score_head_is_refused_before_it_is_built() -> None:
    from core_rl.config.schema import RunConfig
    from core_rl.errors import ConfigError
    from core_rl.testing import recipe_host
    from core_rl_rm.config import RMConfig
    from core_rl_rm.loop import RMLoop

    # recipe_host's stand-in 'fsdp' lists no heads (so: lm only) and cannot be built (its factory is object)
    with pytest.raises(ConfigError, match=r"actor.engine.name: train engine 'fsdp' \(distribution <stand-in>\) cannot"):
        RMLoop(RunConfig(), recipe_host(), config=RMConfig())  # builds its models
