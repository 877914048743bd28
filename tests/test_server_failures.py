"""Inference-server failures as a user of ``core-rl train`` meets them: a URL where no server
answers (vLLM and SGLang engines; exit status 2), and a real vLLM server SIGKILLed mid-run
(examples/server_grpo/vllm.yaml) with no restarts left: the run stops with one message naming the
server and the limit (exit status 1), leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from core_rl.config.loader import structure
from core_rl.errors import CoreRLError
from core_rl.loops.run import is_retriable
from core_rl.testing import preloaded
from core_rl.testing.tiny import build_tiny_model
from core_rl_server_kit.processes import ServerError, pid_alive
from core_rl_server_kit.supervise import session_members

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "server_grpo" / "vllm.yaml"


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_a_url_where_no_server_answers_is_one_message(tmp_path: Path, name: str) -> None:
    plugin = pytest.importorskip(f"core_rl_{name}.engine")
    config_cls = pytest.importorskip(f"core_rl_{name}.config")
    cls = {"vllm": "VLLMConfig", "sglang": "SGLangConfig"}[name]
    config = structure({"server": {"urls": ["http://127.0.0.1:1"]}}, getattr(config_cls, cls))
    engine_cls = {"vllm": "VLLMRolloutEngine", "sglang": "SGLangRolloutEngine"}[name]
    with pytest.raises(CoreRLError) as caught:
        getattr(plugin, engine_cls)(tmp_path / "model", config, tmp_path)
    assert str(caught.value) == (
        f"rollout.engine.server.urls[0]: no {name} server answers at http://127.0.0.1:1 (GET /health: connection "
        "refused). Start the server first or correct the URL; with server.urls empty, core-rl starts its own servers"
    )
    assert caught.value.exit_code == 2


def _wait(what: str, check, proc: subprocess.Popen, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout} s for {what}")


def _steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"step"' in line)
    except OSError:
        return 0


def _server_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


@pytest.mark.server_env("vllm")
def test_a_server_killed_mid_run_ends_it_with_one_message(tmp_path: Path) -> None:
    pytest.importorskip("core_rl_vllm")
    pytest.importorskip("core_rl_fsdp")
    sys.path.insert(0, str(ROOT / "examples" / "tiny_grpo"))
    try:
        from task import LETTERS, write_dataset
    finally:
        sys.path.remove(str(ROOT / "examples" / "tiny_grpo"))
    model = build_tiny_model(tmp_path / "model", alphabet=LETTERS + "=", seed=0, num_heads=2)
    data = write_dataset(tmp_path / "data" / "train.jsonl")
    run = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "core_rl.cli", "train", str(EXAMPLE)),
        f"experiment.output_dir={tmp_path}",
        "experiment.name=run",
        f"actor.model_path={model}",
        f"data.train_files=[{data}]",
        "trainer.total_steps=500",
        "saver.every_n_steps=0",
        "saver.at_end=false",
        "rollout.engine.server.max_restarts=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = preloaded.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        pidfile, metrics = run / "servers" / "vllm-0.pid", run / "metrics.jsonl"
        pid = _wait("the server to start", lambda: _server_pid(pidfile), proc)
        _wait("a step", lambda: _steps(metrics) > 0, proc)
        pids = [pid, *session_members(pid)]
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(err[-3000:])
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    (error,) = [line for line in err.splitlines() if line.startswith("core-rl: error: ")]
    assert error.startswith("core-rl: error: server vllm-0 (http://127.0.0.1:")
    assert "restarted 0 times already: rollout.engine.server.max_restarts (0) reached" in error
    assert "it was killed by signal 9 (SIGKILL)" in error and f"Log {run / 'servers' / 'vllm-0.log'}" in error
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)], "server processes left behind"


def test_recover_auto_resumes_after_a_server_that_died_not_one_that_cannot_serve() -> None:
    """``recover.mode: auto`` starts a new trainer (new servers, the newest checkpoint) after a
    server died mid-run; a server that crashed on its first request, or a configuration error,
    would fail the same way again."""
    assert is_retriable(ServerError("server vllm-0 died while generating", recoverable=True))
    assert not is_retriable(ServerError("server vllm-0 crashed on its first request"))
    assert not is_retriable(CoreRLError("rollout.engine.server.urls[0]: no vllm server answers"))
    assert is_retriable(RuntimeError("a bug"))
