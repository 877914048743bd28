"""Weight loads beside the trainer (core_rl.sync.background_load): the wait joins the load and
raises its error or a timeout naming the version; in an asynchronous run syncing by disk the
trainer trains while the engine loads, never rewrites the directory during a load, and keeps
every sample within the bound."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.rollout.controller import RolloutTimeout
from core_rl.sync.background_load import BackgroundWeightLoad
from core_rl.testing.faults import build_task, merged, run_dir
from fault_helpers import train_here


def test_wait_joins_the_load_and_reports_its_time() -> None:
    loads = BackgroundWeightLoad(5.0, "some.key")
    assert loads.wait() == 0.0  # nothing in flight
    done = threading.Event()
    loads.start(lambda: (time.sleep(0.2), done.set()), version=3)
    assert not done.is_set()  # start() did not wait
    waited = loads.wait()
    assert done.is_set() and 0.1 < waited and loads.last_load_s >= 0.2
    assert loads.wait() == 0.0
    loads.close()


def test_the_load_error_is_raised_where_the_trainer_waits() -> None:
    loads = BackgroundWeightLoad(5.0, "some.key")

    def fail() -> None:
        raise OSError("server gone")

    loads.start(fail, version=2)
    with pytest.raises(OSError, match="server gone"):
        loads.wait()
    assert loads.wait() == 0.0  # reported once
    loads.close()


def test_a_load_past_the_timeout_names_its_version_and_key() -> None:
    loads = BackgroundWeightLoad(0.2, "rollout.controller.wait_timeout_s")
    release = threading.Event()
    loads.start(lambda: release.wait(10), version=7)
    with pytest.raises(RolloutTimeout, match=r"weights of version 7 \(rollout.controller.wait_timeout_s\)"):
        loads.wait()
    with pytest.raises(RuntimeError, match="version 7 still pending"):
        loads.start(lambda: None, version=8)
    release.set()
    loads.close()


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")


def test_an_async_disk_run_trains_while_the_engine_loads(tmp_path: Path, host, monkeypatch) -> None:
    """Loads slowed to 0.4 s: the next step's update runs during a load, no export starts before
    the previous load ended, and staleness stays within the bound."""
    from core_rl.loops.rl.update import PolicyUpdate
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_hf.engine import HFRolloutEngine

    events: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    events.append((name, t0, time.perf_counter()))

        return wrapper

    load = HFRolloutEngine.load_weights_from_path
    monkeypatch.setattr(
        HFRolloutEngine, "load_weights_from_path", timed("load", lambda *a: (time.sleep(0.4), load(*a))[1])
    )
    monkeypatch.setattr(FSDPEngine, "export_hf", timed("export", FSDPEngine.export_hf))
    monkeypatch.setattr(PolicyUpdate, "__call__", timed("update", PolicyUpdate.__call__))
    base = build_task(tmp_path)
    config = merged(
        base,
        experiment={"name": "overlap"},
        trainer={"total_steps": 4, "torch_threads": 1},
        rollout={**base["rollout"], "weight_sync": "disk", "controller": {"max_head_offpolicyness": 1}},
        algorithm={"name": "grpo", "loss": {"name": "ppo_clip", "use_decoupled_loss": True}},
        saver={"every_n_steps": 2, "keep_last": 10, "export_hf": False},
    )
    train_here(config, host)
    rows = read_metrics(run_dir(config) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1.0 for r in rows)
    loads = [(a, b) for name, a, b in events if name == "load"]
    exports = [(a, b) for name, a, b in events if name == "export"]
    updates = [(a, b) for name, a, b in events if name == "update"]
    assert len(loads) == len(exports) == 4
    for (_, load_end), (next_export, _) in zip(loads, exports[1:]):
        assert next_export >= load_end, "the directory was rewritten during a load"
    assert any(a < load_end and b > load_start for load_start, load_end in loads for a, b in updates), (
        "no update ran while the engine loaded"
    )
    assert any(r["timing/weight_load_s"] >= 0.4 for r in rows[1:])
    assert all(r["timing/weight_sync_s"] < 0.4 + r["timing/weight_load_wait_s"] for r in rows)
