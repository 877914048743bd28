"""The ``sglang`` engine giving back its memory while the trainer trains
(``rollout.sleep_while_training``): the exact requests, in order around a weight update and
generation, and a failure named. SGLang's memory saver runs on CUDA only, so a recording HTTP
server stands in for the SGLang server here; ``test_gpu_sleep.py`` runs the real one on a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from core_rl.config.loader import structure
from core_rl.interfaces import SamplingParams
from core_rl.testing.recording_server import RecordingServer, engine_on
from core_rl.testing.sleep import failed_release_message, sleep_cycle
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine


def _generated(body: Any) -> tuple[int, Any]:
    """SGLang's ``/generate`` answer for a batch of prompts: each prompt's last token + 1, + 2, ..."""
    items = []
    for prompt in body["input_ids"]:
        tokens = list(range(prompt[-1] + 1, prompt[-1] + 1 + body["sampling_params"]["max_new_tokens"]))
        meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in tokens]}
        items.append({"output_ids": tokens, "meta_info": meta})
    return 200, items


ANSWERS = {"/generate": _generated, "/update_weights_from_disk": (200, {"success": True, "message": ""})}
RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"


@pytest.fixture
def server():
    with RecordingServer(ANSWERS) as recording:
        yield recording


def test_release_then_resume_weights_for_the_update_and_the_cache_for_generation(server, tmp_path: Path) -> None:
    with engine_on(server, SGLangRolloutEngine, SGLangConfig, tmp_path, sleep=True) as engine:
        sleep_cycle(engine, tmp_path, 1)
        (group,) = engine.generate([[1, 2]], SamplingParams(n=2, max_new_tokens=3))
    posts = [(r.path, r.body) for r in server.requests if r.method == "POST"]
    assert posts[:4] == [
        (RELEASE, {"tags": ["weights", "kv_cache", "cuda_graph"]}),
        (RESUME, {"tags": ["weights"]}),
        ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "1"}),
        (RESUME, {"tags": ["kv_cache", "cuda_graph"]}),
    ]
    assert [p for p, _ in posts[4:]] == ["/generate"]
    assert [s.response_ids for s in group] == [[3, 4, 5]] * 2


def test_without_sleep_nothing_is_sent(server, tmp_path: Path) -> None:
    with engine_on(server, SGLangRolloutEngine, SGLangConfig, tmp_path, sleep=False) as engine:
        engine.release_memory()
        engine.restore_memory()
    assert server.paths("POST") == []


def test_a_failed_release_names_the_server_and_the_endpoint(server, tmp_path: Path) -> None:
    server.answers[RELEASE] = (
        400,
        {"error": {"message": "release_memory_occupation should be called only when no ongoing request"}},
    )
    message = failed_release_message(server, SGLangRolloutEngine, SGLangConfig, tmp_path)
    assert message.startswith(f"server sglang@{server.url} did not release its memory (rollout.sleep_while_training)")
    assert f"POST {server.url}{RELEASE} answered 400" in message and "no ongoing request" in message


def test_the_server_starts_with_the_memory_saver_only_when_asked() -> None:
    config = structure({"server": {"env_variant": "cuda"}}, SGLangConfig, path="rollout.engine")
    engine = SGLangRolloutEngine.__new__(SGLangRolloutEngine)  # the command needs no running server
    engine.config, engine.options, engine.model_path = config, config.server, "/models/m"
    off = engine.server_command("/py", 8000, 0)
    engine.sleeps = True
    assert "--enable-memory-saver" not in off
    assert engine.server_command("/py", 8000, 0) == [*off, "--enable-memory-saver"]
