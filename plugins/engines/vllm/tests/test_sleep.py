"""The ``vllm`` engine sleeping while the trainer trains (``rollout.sleep_while_training``): the
exact requests it sends, in order around a weight update and generation, and its errors. vLLM's
sleep mode runs on CUDA only, so here a recording HTTP server stands in for the vLLM server
(:mod:`core_rl.testing.recording_server`); ``test_gpu_sleep.py`` runs the real one on a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from core_rl.config.loader import structure
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.testing.recording_server import RecordingServer, engine_on
from core_rl.testing.sleep import failed_release_message, sleep_cycle
from core_rl_server_kit.remote import ServerReplyError
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import GENERATE_PATH, UPDATE_ROUTE, VLLMRolloutEngine


def _generated(body: Any) -> tuple[int, Any]:
    """vLLM's ``/inference/v1/generate`` answer: the prompt's last token + 1, + 2, ... for each sample."""
    params, start = body["sampling_params"], body["token_ids"][-1]
    tokens = list(range(start + 1, start + 1 + params["max_tokens"]))
    choice = {
        "token_ids": tokens,
        "logprobs": {"content": [{"logprob": -0.5} for _ in tokens]},
        "finish_reason": "length",
    }
    return 200, {"choices": [{**choice, "index": i} for i in range(params["n"])]}


ANSWERS = {
    "/v1/models": (200, {"data": [{"id": "core-rl"}]}),
    GENERATE_PATH: _generated,
    UPDATE_ROUTE: (200, {"results": [None]}),
}
SAMPLING = SamplingParams(n=2, max_new_tokens=3)


@pytest.fixture
def server():
    with RecordingServer(ANSWERS) as recording:
        yield recording


def _posts(server: RecordingServer) -> list[str]:
    return server.paths("POST")


def test_sleep_then_wake_weights_for_the_update_and_the_cache_for_generation(server, tmp_path: Path) -> None:
    with engine_on(server, VLLMRolloutEngine, VLLMConfig, tmp_path, sleep=True) as engine:
        engine.generate([[1, 2]], SAMPLING)
        engine.release_memory()
        engine.release_memory()  # released already: nothing sent
        with pytest.raises(CoreRLError, match="generate while its servers' memory is released"):
            engine.generate([[1, 2]], SAMPLING)
        engine.restore_memory(["weights"])
        engine.load_weights_from_path(tmp_path, 1)
        engine.restore_memory(["kv_cache"])
        engine.restore_memory()  # nothing left asleep: nothing sent
        (group,) = engine.generate([[1, 2]], SAMPLING)
    assert _posts(server) == [
        GENERATE_PATH,
        "/sleep?level=2",
        "/wake_up?tags=weights",
        UPDATE_ROUTE,
        "/wake_up?tags=kv_cache",
        GENERATE_PATH,
    ]
    (update,) = [r.body for r in server.requests if r.path == UPDATE_ROUTE]
    assert update["pause"] is False  # vLLM's sleep holds the scheduler; nothing runs
    assert [s.response_ids for s in group] == [[3, 4, 5]] * 2 and group[0].weight_version == 1


def test_one_wake_up_for_both_parts(server, tmp_path: Path) -> None:
    with engine_on(server, VLLMRolloutEngine, VLLMConfig, tmp_path, sleep=True) as engine:
        engine.release_memory()
        engine.restore_memory()
    assert _posts(server) == ["/sleep?level=2", "/wake_up?tags=weights&tags=kv_cache"]


def test_without_sleep_nothing_is_sent_and_updates_pause_as_before(server, tmp_path: Path) -> None:
    with engine_on(server, VLLMRolloutEngine, VLLMConfig, tmp_path, sleep=False) as engine:
        sleep_cycle(engine, tmp_path, 1)  # nothing asleep: no request but the update's
        engine.generate([[1, 2]], SAMPLING)
    assert _posts(server) == [UPDATE_ROUTE, GENERATE_PATH]
    assert server.requests[-2].body["pause"] is True


def test_a_failed_sleep_names_the_server_and_the_endpoint(server, tmp_path: Path) -> None:
    server.answers["/sleep"] = (500, {"error": "sleep mode is not enabled"})
    message = failed_release_message(server, VLLMRolloutEngine, VLLMConfig, tmp_path)
    assert message.startswith(f"server vllm@{server.url} did not release its memory (rollout.sleep_while_training): ")
    assert f"POST {server.url}/sleep?level=2 answered 500" in message and "sleep mode is not enabled" in message


def test_a_failed_wake_up_names_the_server_and_keeps_generation_refused(server, tmp_path: Path) -> None:
    server.answers["/wake_up"] = (503, {"error": "CUDA out of memory"})
    with engine_on(server, VLLMRolloutEngine, VLLMConfig, tmp_path, sleep=True) as engine:
        engine.release_memory()
        with pytest.raises(ServerReplyError, match=r"did not take back its weights memory .*/wake_up\?tags=weights"):
            engine.restore_memory(["weights"])
        with pytest.raises(CoreRLError, match="memory is released"):
            engine.generate([[1, 2]], SAMPLING)


def test_release_with_requests_in_flight_is_refused(server, tmp_path: Path) -> None:
    with engine_on(server, VLLMRolloutEngine, VLLMConfig, tmp_path, sleep=True) as engine:
        engine._inflight = 2  # as while a generation batch runs
        with pytest.raises(CoreRLError, match="release_memory\\(\\) with 2 requests in flight"):
            engine.release_memory()
        engine._inflight = 0
    assert "/sleep?level=2" not in _posts(server)


def test_the_server_starts_able_to_sleep_only_when_asked(tmp_path: Path) -> None:
    config = structure({"server": {"env_variant": "cuda"}, "extra_args": ["--x"]}, VLLMConfig, path="rollout.engine")
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # the command needs no running server
    engine.config, engine.options, engine.model_path = config, config.server, "/models/m"
    off = engine.server_command("/py", 8000, 0)
    engine.sleeps = True
    on = engine.server_command("/py", 8000, 0)
    assert "--enable-sleep-mode" not in off
    assert on == [*off[:-1], "--enable-sleep-mode", "--x"]  # before extra_args, which may override
    assert engine.server_environment(0)["VLLM_SERVER_DEV_MODE"] == "1"  # the /sleep and /wake_up routes
