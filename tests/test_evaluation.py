"""Evaluation on held-out prompts while training (the ``eval:`` section): ``core-rl train`` with the
real plugins (fsdp, hf, grpo, char_match) on a tiny model evaluates on schedule, writes every answer,
and trains exactly as the same run without evaluation; on 2 ranks and in an asynchronous run too.
Configuration and data mistakes are refused before anything is built."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.config.loader import load_config
from core_rl.errors import ConfigError, PreflightError
from core_rl.eval.evaluator import training_randomness_kept
from core_rl.loops.preflight import preflight
from core_rl.plugins.host import PluginHost
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

TRAINING = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/entropy")
EVAL_ROWS = [("ab", "x"), ("ba", "x"), ("abc", "y"), ("dca", "x"), ("bd", "y")]


def _rows(pairs) -> str:
    return "".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1], "src": src}) + "\n" for s, src in pairs)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    (root / "train.jsonl").write_text(_rows([(s, "t") for s in ("ab", "ba", "abc", "dca", "bd", "cc")]))
    (root / "eval.jsonl").write_text(_rows(EVAL_ROWS))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(root / "train.jsonl")], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 3, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False, "export_hf": False},
        "loggers": [{"name": "console"}],
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "model": model}


#: evaluation before step 1, after step 2 (every 2) and after step 3 (the last), 3 sampled answers
#: per prompt, 2 prompts per generation batch (the last batch holds one)
EVAL = (
    "eval.files=[{root}/eval.jsonl]",
    "eval.before_train=true",
    "eval.every_n_steps=2",
    "eval.batch_size=2",
    "eval.group_by=src",
    "eval.sampling.greedy=false",
    "eval.sampling.n=3",
    "eval.sampling.temperature=1.5",
    "eval.pass_reward=0.5",
)


def _eval_overrides(setup) -> list[str]:
    return [o.format(root=setup["root"]) for o in EVAL]


def test_evaluation_on_schedule_leaves_training_as_it_was(setup) -> None:
    runs = setup["root"] / "runs"
    run_train(setup["config"], "experiment.name=plain")
    proc = run_train(setup["config"], "experiment.name=evaluated", *_eval_overrides(setup))
    plain = read_metrics(runs / "plain" / "metrics.jsonl")
    rows = read_metrics(runs / "evaluated" / "metrics.jsonl")
    evaluated = {r["step"]: r for r in rows}
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {s for s, r in evaluated.items() if "eval/reward/mean" in r} == {0, 2, 3}
    # the evaluation drew its own randomness: training sampled and trained exactly as without it
    for row in plain:
        for key in TRAINING:
            assert evaluated[row["step"]][key] == row[key], (row["step"], key)
    for step in (0, 2, 3):
        m = evaluated[step]
        assert (m["eval/prompts"], m["eval/samples"], m["eval/dropped"]) == (5, 15, 0)
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@3", "eval/best_reward/mean", "timing/eval_s"} <= set(m)
        assert (m["eval/src=x/prompts"], m["eval/src=y/prompts"]) == (3, 2)
        records = [json.loads(line) for line in (runs / "evaluated" / "eval" / f"step_{step:06d}.jsonl").open()]
        assert len(records) == 15 and {r["step"] for r in records} == {step}
        # char_match reads the whole (normalised) response as the answer: maj@n from the records
        majority = []
        for index in range(5):
            mine = [r for r in records if r["prompt_index"] == index and r["answer"] is not None]
            votes = ["".join(r["answer"].split()) for r in mine]
            top = max(votes, key=votes.count) if votes else None
            majority.append(top is not None and next(r["correct"] for r in mine if "".join(r["answer"].split()) == top))
        assert m["eval/maj@n"] == pytest.approx(sum(majority) / 5)
        assert [r["prompt_index"] for r in records] == [i for i in range(5) for _ in range(3)]
        assert [r["prompt"] for r in records[::3]] == [f"{s}=" for s, _ in EVAL_ROWS]
        assert [r["src"] for r in records[::3]] == [src for _, src in EVAL_ROWS]
        # the file holds what the metrics sum up
        assert m["eval/reward/mean"] == pytest.approx(statistics.fmean(r["reward"] for r in records))
        assert all(r["correct"] == (r["reward"] >= 0.5) for r in records)
        truncated = statistics.fmean(r["finish_reason"] == "length" for r in records)
        assert m["eval/truncated"] == pytest.approx(truncated)
    assert not (runs / "plain" / "eval").exists()
    last = evaluated[3]
    line = f"eval:       step 3: reward {last['eval/reward/mean']:.4g}, pass@1 {last['eval/pass@1']:.4g} over 5 prompts"
    assert f"{line} ({runs / 'evaluated' / 'eval'})" in proc.stdout


def test_evaluation_on_two_ranks_of_an_asynchronous_run(setup) -> None:
    """Rank 0 evaluates, beside its rollout controller generating ahead, with the weights of the
    step, while the other rank waits for it."""
    runs = setup["root"] / "runs"
    run_train(
        setup["config"],
        "experiment.name=two_ranks_async",
        *_eval_overrides(setup),
        "eval.every_n_steps=1",
        "trainer.total_steps=2",
        "rollout.controller.max_head_offpolicyness=1",
        nproc=2,
        cpu=True,
    )
    rows = read_metrics(runs / "two_ranks_async" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["eval/samples"] == 15 for r in rows)
    assert rows[1]["async/max_head_offpolicyness"] == 1 and "actor/loss" in rows[2]
    written = sorted(p.name for p in (runs / "two_ranks_async" / "eval").iterdir())
    assert written == [f"step_{s:06d}.jsonl" for s in (0, 1, 2)]


def test_evaluation_keeps_the_random_streams_of_training(setup) -> None:
    """What the hf engine draws while evaluating (torch's global generator without a seed; its own
    with one) is undone afterwards; without ``keep`` it is not."""
    from core_rl.interfaces import SamplingParams
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=4)
    for seed in (None, 7):
        engine = HFRolloutEngine(setup["model"], HFRolloutConfig(device="cpu", seed=seed))
        before_torch, before_engine, before_py = torch.get_rng_state(), engine.state_dict(), random.getstate()
        before_np = np.random.get_state()[1].copy()
        with training_randomness_kept(engine, keep=True):
            engine.generate([[5, 6]], params)
            random.random(), np.random.random()  # what a workflow or reward might draw
        assert torch.equal(torch.get_rng_state(), before_torch) and random.getstate() == before_py
        assert (np.random.get_state()[1] == before_np).all()
        if seed is not None:
            assert torch.equal(engine.state_dict()["generator"]["state"], before_engine["generator"]["state"])
        with training_randomness_kept(engine, keep=False):
            engine.generate([[5, 6]], params)
        if seed is not None:
            assert not torch.equal(engine.state_dict()["generator"]["state"], before_engine["generator"]["state"])
        else:
            assert not torch.equal(torch.get_rng_state(), before_torch)
        engine.close()


def _load(setup, *overrides: str):
    return load_config(setup["config"], list(overrides), host=PluginHost())


def test_evaluation_mistakes_are_refused_with_their_key(setup) -> None:
    files = f"eval.files=[{setup['root']}/eval.jsonl]"
    cases = {
        ("eval.every_n_steps=2",): "eval.files: required",
        (files, "eval.sampling.n=4"): "eval.sampling.n: greedy decoding",
        (files, "eval.sampling.max_new_tokens=2", "rollout.sampling.min_new_tokens=3"): (
            "eval.sampling: merged into rollout.sampling, min_new_tokens must be <= max_new_tokens"
        ),
        (files, "eval.sampling.top_p=0"): "eval.sampling.top_p: must be in (0.0, 1.0]",
        (files, "eval.sampling.min_p=1"): "eval.sampling.min_p: must be in [0.0, 1.0), got 1.0",
        (
            files,
            "eval.sampling.repetition_penalty=0",
        ): "eval.sampling.repetition_penalty: must be in (0.0, 2.0], got 0.0",
        (files, "reward=null", "reward_model.model_path=x"): "eval: answers are scored by the run's reward",
        (files, "eval.group_by=''"): "eval.group_by: must not be empty",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as info:
            _load(setup, *overrides)
        assert any(message in p for p in info.value.problems), (overrides, info.value.problems)


def test_evaluation_data_is_checked_before_the_run(setup, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "ab=", "answer": "ba", "src": "x"})
        + "\n"
        + json.dumps({"question": "ba=", "answer": "ab", "src": "x"})
        + "\n"
        + json.dumps({"prompt": "bd=", "src": "y"})
        + "\n"
        + json.dumps({"prompt": "ab" * 40 + "=", "answer": "x", "src": "y"})
        + "\n"
    )
    cfg = _load(
        setup,
        f"eval.files=[{bad}]",
        "eval.group_by=src",
        f"experiment.output_dir={tmp_path / 'runs'}",
        "data.max_prompt_tokens=32",
    )
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    text = "\n".join(info.value.problems)
    assert f"{bad}:2: no column 'prompt'" in text and "set data.prompt_key (or eval.prompt_key)" in text
    assert f"{bad}:3: no column 'answer'" in text and "reward 'char_match'" in text
    cfg = _load(setup, f"eval.files=[{bad}]", "eval.max_prompts=1", "eval.group_by=lang", "eval.prompt_key=prompt")
    with pytest.raises(PreflightError) as info:
        preflight(cfg, create_output_dir=False)
    assert any(f"{bad}:1: no column 'lang'" in p and "eval.group_by" in p for p in info.value.problems)
    cfg = _load(setup, f"eval.files=[{tmp_path / 'absent.jsonl'}]")
    with pytest.raises(PreflightError) as info:
        preflight(cfg, create_output_dir=False)
    assert f"eval.files: '{tmp_path / 'absent.jsonl'}' does not exist" in info.value.problems
    # the first row alone, long enough with eval's own max_new_tokens to pass the model's context
    cfg = _load(setup, f"eval.files=[{bad}]", "eval.max_prompts=1", "eval.sampling.max_new_tokens=4000")
    with pytest.raises(PreflightError) as info:
        preflight(cfg, create_output_dir=False)
    assert any(
        p.startswith("eval.sampling.max_new_tokens: 4000 tokens after the longest prompt of eval.files")
        and p.endswith("lower it or use shorter prompts")
        for p in info.value.problems
    )
    # eval's max_new_tokens inherited from rollout's: the message says where it came from
    cfg = _load(setup, f"eval.files=[{bad}]", "eval.max_prompts=1", "rollout.sampling.max_new_tokens=4000")
    with pytest.raises(PreflightError) as info:
        preflight(cfg, create_output_dir=False)
    assert any(
        p.startswith(
            "eval.sampling.max_new_tokens (rollout.sampling.max_new_tokens, inherited): 4000 tokens after the "
            "longest prompt of eval.files"
        )
        and p.endswith("set eval.sampling.max_new_tokens lower or use shorter prompts")
        for p in info.value.problems
    ), info.value.problems


def test_core_rl_eval_of_the_starting_model_is_a_training_runs_first_evaluation(setup, capsys) -> None:
    """``core-rl eval`` (no training): the metrics and answers of a training run's evaluation before
    its first step, here sampled (3 answers a prompt from the ``hf`` engine's seeded generator), as
    one JSON object or a table and the summary line; the answers under its own run directory."""
    from core_rl import cli

    runs = setup["root"] / "runs"
    common = [*_eval_overrides(setup), "rollout.engine.seed=11", "trainer.total_steps=1"]
    assert cli.main(["train", str(setup["config"]), "experiment.name=first_eval", *common]) == 0
    want = {k: v for k, v in read_metrics(runs / "first_eval" / "metrics.jsonl")[0].items() if k.startswith("eval/")}
    assert want["eval/prompts"] == len(EVAL_ROWS) and want["eval/samples"] == 3 * len(EVAL_ROWS)
    capsys.readouterr()
    assert cli.main(["eval", str(setup["config"]), "experiment.name=eval_alone", *common, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got.pop("timing/eval_s") > 0 and got == want
    answers = (runs / "eval_alone" / "eval" / "step_000000.jsonl").read_text()
    assert answers == (runs / "first_eval" / "eval" / "step_000000.jsonl").read_text()
    assert not (runs / "eval_alone" / "metrics.jsonl").exists()  # nothing trained, nothing logged

    assert cli.main(["eval", str(setup["config"]), "experiment.name=eval_table", *common, "--step", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["eval/pass@1", f"{want['eval/pass@1']:.6g}"] for line in lines), lines
    assert lines[-1].startswith("eval:       step 7: reward ") and "over 5 prompts" in lines[-1]
    assert (runs / "eval_table" / "eval" / "step_000007.jsonl").is_file()


def test_core_rl_eval_without_an_eval_section_is_one_message(setup, capsys) -> None:
    from core_rl import cli

    assert cli.main(["eval", str(setup["config"]), "experiment.name=no_eval"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "core-rl: error: invalid configuration:",
        "  - eval: the configuration has no eval section; add eval.files (the prompts to evaluate)",
    ]


def test_greedy_evaluation_in_one_batch_answers_as_in_chunks(setup, monkeypatch, capsys) -> None:
    """``eval.batch_size: auto`` (the default) sends every prompt to the engine in one ``generate``
    call, where ``data.batch_size`` chunks (``eval.batch_size: 0``) took one per 2 prompts; greedy
    answers and metrics are the same, in the same order."""
    from core_rl import cli
    from core_rl.config.eval_config import EvalConfig, EvalSamplingConfig
    from core_rl.config.validators import MAX_COUNT
    from core_rl_hf.engine import HFRolloutEngine

    sampled = EvalConfig(files=["x"], sampling=EvalSamplingConfig(greedy=False, n=4))
    assert (sampled.prompts_per_batch(10, 2), sampled.prompts_per_batch(MAX_COUNT, 2)) == (10, MAX_COUNT // 4)
    # 13 prompts of 1 to 6 characters, answers up to 8 tokens
    words = ["".join("abcd"[(i * 7 + j * 3) % 4] for j in range(1 + i % 6)) for i in range(13)]
    (setup["root"] / "many.jsonl").write_text(_rows([(w, "x") for w in words]))
    calls: list[int] = []
    generate = HFRolloutEngine.generate

    def counted(self, prompts, sampling):
        calls.append(len(prompts))
        return generate(self, prompts, sampling)

    monkeypatch.setattr(HFRolloutEngine, "generate", counted)
    runs = setup["root"] / "runs"
    got = {}
    for name, size in (("chunks", "0"), ("auto", "auto")):
        calls.clear()
        overrides = [f"eval.files=[{setup['root']}/many.jsonl]", f"eval.batch_size={size}"]
        args = ["eval", str(setup["config"]), f"experiment.name=batches_{name}", *overrides]
        assert cli.main([*args, "eval.sampling.max_new_tokens=8", "--json"]) == 0
        metrics = json.loads(capsys.readouterr().out)
        metrics.pop("timing/eval_s")
        answers = (runs / f"batches_{name}" / "eval" / "step_000000.jsonl").read_text()
        got[name] = (list(calls), metrics, answers)
    assert got["chunks"][0] == [2] * 6 + [1] and got["auto"][0] == [13]
    assert got["auto"][1] == got["chunks"][1] and got["auto"][1]["eval/prompts"] == 13
    assert got["auto"][2] == got["chunks"][2]
    assert [json.loads(line)["prompt"] for line in got["auto"][2].splitlines()] == [f"{w}=" for w in words]
