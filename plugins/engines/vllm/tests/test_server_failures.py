"""A real vLLM server (from the managed ``vllm`` server environment) killed with SIGKILL inside the
weight-update window, by disk and by collective, and while generating; a model whose server
crashes on its first request. One engine serves the kill tests in order (each kill costs a
restart, ~35 s); the last one leaves it stopped."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.testing.contracts import hf_logprobs
from core_rl.testing.tiny import build_tiny_model
from core_rl_server_kit.processes import ServerError
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import VLLMRolloutEngine
from safetensors.torch import load_file

PROMPT = [1, 10, 11, 12]
GREEDY = SamplingParams(n=1, max_new_tokens=8, greedy=True)


pytestmark = pytest.mark.server_env("vllm")  # real vLLM servers (see the repository's conftest.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models of one shape (head size 32) with different random weights."""
    root = tmp_path_factory.mktemp("models")
    return {
        "a": build_tiny_model(root / "a", seed=0, num_heads=2),
        "b": build_tiny_model(root / "b", seed=1, num_heads=2),
    }


def make_engine(model: Path, run_dir: Path, **server: Any) -> VLLMRolloutEngine:
    options = {"dtype": "float32", "server": {"retry_backoff": 0.2, **server}}
    return VLLMRolloutEngine(model, structure(options, VLLMConfig), run_dir)


@pytest.fixture(scope="module")
def server_tmp() -> Iterator[Path]:
    """The system's temporary directory of this module's servers and their supervisors (``TMPDIR``),
    short, as the Unix socket paths under it must be."""
    with (
        tempfile.TemporaryDirectory(prefix="core-rl-t-") as path,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setenv("TMPDIR", path)
        yield Path(path)


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, server_tmp: Path):
    engine = make_engine(models["a"], tmp_path_factory.mktemp("run"), max_restarts=4)
    yield engine
    engine.close()


def kill(engine: VLLMRolloutEngine) -> int:
    """SIGKILL the engine's server; return its pid once it is gone."""
    server = engine.endpoints[0].server
    assert server is not None and server.pid is not None
    pid = server.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.alive()
    return pid


def assert_serves(engine: VLLMRolloutEngine, model: Path, version: int) -> None:
    """The server generates with ``model``'s weights, labelled ``version``: the log-probs of its
    greedy tokens are those of a transformers forward of ``model``."""
    (sample,) = engine.generate([PROMPT], GREEDY)[0]
    assert sample.weight_version == version and set(sample.versions) == {version}
    ids = torch.tensor([PROMPT + sample.response_ids])
    reference = hf_logprobs(model, ids, torch.ones_like(ids))[0, len(PROMPT) :]
    assert torch.allclose(torch.tensor(sample.logprobs), reference, atol=1e-3), (sample.logprobs, reference)


def logs(engine: VLLMRolloutEngine) -> list[str]:
    return sorted(p.name for p in (engine.run_dir / "servers").glob("*.log"))


def test_killed_after_pause_in_a_disk_update_restarts_and_loads_the_update(engine, models, server_tmp) -> None:
    assert_serves(engine, models["a"], 0)
    # the executor's rendezvous store lives in the server's runtime directory, which goes with it
    (runtime,) = server_tmp.glob("core-rl-*")
    assert len(list(runtime.glob("vllm_dist_*"))) == 1 and not list(server_tmp.glob("vllm_dist_*"))
    engine.pause("abort")  # as the rollout controller pauses for an update
    kill(engine)
    engine.load_weights_from_path(models["b"], 1)
    engine.resume()
    ep = engine.endpoints[0]
    assert ep.restarts == 1 and engine.weight_version == 1
    assert_serves(engine, models["b"], 1)
    # each start keeps its own log; the first one's ends where the server was killed
    assert logs(engine) == ["vllm-0.log", "vllm-0.restart1.log"]
    assert engine.server_logs() == {"vllm-0": engine.run_dir / "servers" / "vllm-0.restart1.log"}


def test_killed_after_pause_in_a_collective_update_joins_a_new_group(engine, models) -> None:
    engine.pause("abort")
    kill(engine)
    engine.update_weights_collective(load_file(models["a"] / "model.safetensors"), 2)
    engine.resume()
    assert engine.endpoints[0].restarts == 2 and engine.weight_version == 2
    assert_serves(engine, models["a"], 2)


def test_killed_between_a_collective_update_and_resume_gets_the_update_again(engine, models) -> None:
    engine.pause("abort")
    engine.update_weights_collective(load_file(models["b"] / "model.safetensors"), 3)
    kill(engine)
    engine.resume()  # restarts it, forms a new group and broadcasts version 3 again
    assert engine.endpoints[0].restarts == 3
    assert_serves(engine, models["b"], 3)
    assert logs(engine) == [f"vllm-0.{n}log" for n in ("", "restart1.", "restart2.", "restart3.")]


def test_killed_while_generating_after_a_collective_update_stops_the_run(engine) -> None:
    """Outside an update the weights of a collective are not at hand: with no other server to
    carry on, the engine stops with a recoverable error naming the server (restarts are left)."""
    ep = engine.endpoints[0]
    result: dict[str, Any] = {}

    def generate() -> None:
        try:
            engine.generate([[1, 10 + i, 11] for i in range(8)], SamplingParams(n=4, max_new_tokens=200))
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while ep.inflight == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    kill(engine)
    thread.join(120)
    error = result.get("error")
    assert isinstance(error, ServerError), error
    message = str(error)
    print(message.splitlines()[0])
    assert message.startswith(f"server vllm-0 ({ep.url}) died while generating")
    assert "cannot get back the weights of version 3: they came over a collective" in message
    assert "killed by signal 9 (SIGKILL)" in message and "vllm-0.restart3.log" in message
    assert error.exit_code == 1 and error.recoverable
    assert ep.restarts == 3  # not restarted
    with pytest.raises(ServerError) as again:  # every later call says the same
        engine.resume()
    assert again.value is error


def test_the_killed_servers_left_nothing_in_the_temporary_directory(engine, server_tmp: Path) -> None:
    """The four servers killed above each had a private runtime directory, which its supervisor
    removed: their ZMQ sockets and the ``file://`` store of their executor's one-rank group went
    with it. vLLM's own place for that store (``vllm_dist_<hex>``) is the temporary directory, where
    a killed server leaves it unless a process of its own still ends cleanly."""

    def left() -> list[str]:  # torch's compile cache (torchinductor_USER) is a cache, meant to stay
        return sorted(p.name for p in server_tmp.iterdir() if not p.name.startswith("torchinductor_"))

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)  # the last supervisor removing its runtime directory
    assert left() == []


def test_a_server_that_crashes_on_its_first_request_is_not_restarted(tmp_path: Path, monkeypatch) -> None:
    """Head size 16: vLLM's CPU attention raises on the first request and the server exits. The
    error quotes the server's own error line and the server is not restarted into the same crash
    (the check that refuses such a model at start is turned off here to reach the crash)."""
    model = build_tiny_model(tmp_path / "h16", seed=0, num_heads=4)
    with pytest.raises(CoreRLError, match="has attention head size 16, which vLLM's CPU attention does not support"):
        make_engine(model, tmp_path / "refused")
    assert not (tmp_path / "refused" / "servers").exists()  # refused before any server started
    monkeypatch.setattr(VLLMRolloutEngine, "check_model", lambda self: None)
    engine = make_engine(model, tmp_path / "run")
    try:
        with pytest.raises(ServerError) as caught:
            engine.generate([PROMPT], GREEDY)
        message = str(caught.value)
        print(message.splitlines()[0])
        assert "crashed on its first request while generating" in message
        assert "its error: RuntimeError: Unsupported CPU attention configuration: head_dim=16" in message
        assert engine.endpoints[0].restarts == 0 and not caught.value.recoverable
        assert logs(engine) == ["vllm-0.log"]
    finally:
        engine.close()
