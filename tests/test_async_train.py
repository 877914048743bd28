"""Training through the rollout controller (fsdp + hf + grpo, tiny model, in this process unless
noted): bound 0 reproduces the previous synchronous loop bit for bit; an asynchronous run keeps
every trained sample within the bound and reports staleness and utilisation; a trainer killed
(SIGKILL) during an asynchronous run and resumed trains on every prompt exactly once."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, checkpoint, merged, run_dir, stable_metrics, state_digest, wait_for_steps
from fault_helpers import cli_env, train_here

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

HERE = Path(__file__).resolve().parent
CONTROLLER_KEYS = ("async/", "staleness/")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return merged(build_task(tmp_path_factory.mktemp("async")), trainer={"total_steps": 3, "torch_threads": 1})


def previous_sync_rollout(self):
    """The synchronous loop's rollout before the controller: draw a batch, one generate call
    (``self``: the trainer)."""
    from core_rl.loops.rl.rollout_flow import flatten_groups

    prompts = self.data.next_batch()
    groups = flatten_groups(prompts, self.rollout.generate([p.prompt_ids for p in prompts], self.sampling))
    return (*groups, {})  # no draw metrics (data.difficulty_filter is off)


def without_controller_keys(metrics: dict) -> dict:
    return {s: {k: v for k, v in m.items() if not k.startswith(CONTROLLER_KEYS)} for s, m in metrics.items()}


@pytest.mark.parametrize("seeded", [False, True])
def test_bound_zero_is_the_synchronous_run_exactly(base, host, monkeypatch, seeded) -> None:
    """Default controller (bound 0, wave batching) vs the previous synchronous rollout: the same
    metrics and bitwise the same weights, with the engine's own generator or torch's global one."""
    engine = {"name": "hf", "seed": 7} if seeded else {"name": "hf"}
    rollout = {**base["rollout"], "engine": engine}
    controlled = merged(base, experiment={"name": f"ctl{seeded}"}, rollout=rollout)
    train_here(controlled, host)
    from core_rl.loops.rl.loop import SyncTrainer

    init = SyncTrainer.__init__

    def with_previous_rollout(self, *args, **kwargs) -> None:  # the scoring stage draws the previous way
        init(self, *args, **kwargs)
        self.scoring._rollout = functools.partial(previous_sync_rollout, self)

    monkeypatch.setattr(SyncTrainer, "__init__", with_previous_rollout)
    reference = merged(base, experiment={"name": f"ref{seeded}"}, rollout=rollout)
    train_here(reference, host)
    got, want = stable_metrics(run_dir(controlled)), stable_metrics(run_dir(reference))
    assert without_controller_keys(got) == without_controller_keys(want)
    assert all(m["staleness/max"] == 0.0 and m["staleness/hist_0"] == 1.0 for m in got.values())
    assert state_digest(checkpoint(run_dir(controlled), 3)) == state_digest(checkpoint(run_dir(reference), 3))


def test_async_run_stays_within_the_bound_and_reports(base, host) -> None:
    config = merged(
        base,
        experiment={"name": "async2"},
        trainer={"total_steps": 5, "torch_threads": 1},
        rollout={**base["rollout"], "controller": {"max_head_offpolicyness": 2, "warn_wait_fraction": 0.0}},
        algorithm={"name": "grpo", "loss": {"name": "ppo_clip", "use_decoupled_loss": True}},
    )
    train_here(config, host)
    rows = read_metrics(run_dir(config) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert 0.0 <= r["staleness/max"] <= 2.0
        assert sum(r.get(f"staleness/hist_{k}", 0.0) for k in range(3)) == pytest.approx(1.0)
        assert 0.0 <= r["throughput/rollout_utilization"] <= 1.0 and 0.0 <= r["throughput/train_utilization"] <= 1.0
        assert r["async/max_head_offpolicyness"] == 2.0


def expected_prompts(config: dict, batches: int) -> list[str]:
    """The prompts of the first ``batches`` generation batches, in data order."""
    from core_rl.config.schema import DataConfig
    from core_rl.data.prompts import PromptSource
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config["actor"]["model_path"])
    data = PromptSource(DataConfig(**config["data"]), tokenizer, seed=config["experiment"]["seed"])
    return [p.row["prompt"] for _ in range(batches) for p in data.next_batch()]


def test_killed_async_run_resumes_without_losing_or_repeating_a_prompt(base, tmp_path: Path) -> None:
    steps, n, batch = 8, base["rollout"]["sampling"]["n"], base["data"]["batch_size"]
    config = merged(
        base,
        experiment={"name": "killed"},
        trainer={"total_steps": steps, "torch_threads": 1},
        rollout={**base["rollout"], "controller": {"max_head_offpolicyness": 2}},
        reward={"name": "recording"},
        reward_runner={"num_workers": 1},
        recover={"mode": "auto"},
    )
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(config))
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    cmd = [sys.executable, str(HERE / "async_record_run.py"), str(path)]
    proc = preloaded.Popen([*cmd, str(first)], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for_steps(run_dir(config), proc, 3, timeout=600), proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    saved = int((run_dir(config) / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 2 <= saved < steps  # step 3 was logged; its checkpoint may not be written yet
    done = preloaded.run([*cmd, str(second)], env=cli_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    before = first.read_text().splitlines()[: saved * batch * n]  # what the saved steps trained on
    trained = before + second.read_text().splitlines()
    assert len(trained) == steps * batch * n
    groups = [trained[i : i + n] for i in range(0, len(trained), n)]
    assert all(len(set(g)) == 1 for g in groups)  # each group is one prompt's n samples
    assert [g[0] for g in groups] == expected_prompts(config, steps)
