"""The ``judge`` reward against an OpenAI-style chat endpoint on the loopback, started by the test:
the request it sends, the score parsed from the reply (last or first match) and scaled, a reply
without a score counted as unparsed (NaN for the runner), retries, concurrency, the reward
contract, and configuration mistakes. A real vLLM server as the judge: tests/test_judge_vllm.py."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import core_rl_reward_remote.plugin
import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input
from core_rl.testing.recording_server import QuietHTTPServer
from core_rl_reward_remote.config import JudgeConfig
from core_rl_reward_remote.judge import JudgeReward
from core_rl_reward_remote.reward import RemoteRewardError


class ChatEndpoint:
    """``POST /v1/chat/completions`` (also under ``/flaky/v1``: HTTP 503 once per prompt first).
    The judge reads the last user message: ``"?"`` gets no score; otherwise it "thinks" with a
    wrong score first and ends with ``Score: <length of the message>``."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                user = body["messages"][-1]["content"]
                with endpoint.lock:
                    seen = sum(b["messages"][-1]["content"] == user for b in endpoint.bodies)
                    endpoint.bodies.append(body)
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                try:
                    if self.path.startswith("/flaky") and seen == 0:
                        return self.send(503, {"error": "busy"})
                    content = "no idea" if user == "?" else f"maybe Score: 99... no. Score: {len(user)}"
                    threading.Event().wait(0.05)
                    self.send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})
                finally:
                    with endpoint.lock:
                        endpoint.in_flight -= 1

            def send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[ChatEndpoint]:
    e = ChatEndpoint()
    yield e
    e.stop()


def judge(endpoint: ChatEndpoint, prefix: str = "", **options: Any) -> JudgeReward:
    options = {"url": f"{endpoint.url}{prefix}/v1", "prompt": "{response}", "backoff_s": 0.01, **options}
    return JudgeReward(structure(options, JudgeConfig, path="reward"))


def test_the_request_and_the_scaled_last_score(endpoint: ChatEndpoint) -> None:
    reward = judge(
        endpoint,
        model="judge-7b",
        system="be strict",
        prompt="Q: {prompt} A: {response} ref: {answer}",
        answer_key="answer",
        max_score=20.0,
        max_tokens=64,
    )
    endpoint.bodies.clear()
    result = reward.score_with_parts([make_reward_input("abc", {"answer": "cba"}, prompt="rev")])
    reward.close()
    (body,) = endpoint.bodies
    user = "Q: rev A: abc ref: cba"
    assert body == {
        "model": "judge-7b",
        "messages": [{"role": "system", "content": "be strict"}, {"role": "user", "content": user}],
        "temperature": 0.0,
        "max_tokens": 64,
    }
    # the last "Score:" (the message's length, 22), not the 99 thought of first; 22 / 20 clipped to 1
    assert result.parts["score"] == [22.0] and result.scores == [1.0] and result.parts["unparsed"] == [0.0]


def test_first_match_scaling_and_an_unparsed_reply(endpoint: ChatEndpoint) -> None:
    reward = judge(endpoint, score_match="first", min_score=0.0, max_score=198.0, max_concurrent_requests=3)
    endpoint.max_in_flight = 0
    result = reward.score_with_parts([make_reward_input(x) for x in ("ab", "?", "abcd", "a", "abc")])
    reward.close()
    assert result.scores[0] == pytest.approx(0.5)  # 99 of [0, 198]
    assert math.isnan(result.scores[1]) and result.parts["score"][1] is None
    assert result.parts["unparsed"] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert endpoint.max_in_flight >= 2  # requests overlapped


def test_a_busy_endpoint_is_retried_and_a_down_one_is_an_error(endpoint: ChatEndpoint) -> None:
    reward = judge(endpoint, prefix="/flaky", max_retries=2)
    assert reward.score([make_reward_input("xyz")]) == [pytest.approx(0.3)]
    reward.close()
    down = JudgeReward(structure({"url": "http://127.0.0.1:9/v1", "max_retries": 1, "backoff_s": 0.01}, JudgeConfig))
    with pytest.raises(RemoteRewardError, match=r"reward 'judge': http://127.0.0.1:9/v1/chat/completions failed 2"):
        down.score([make_reward_input("x")])
    down.close()


def test_an_unparsed_reply_goes_through_the_runners_error_policy(endpoint: ChatEndpoint) -> None:
    from core_rl.config.schema import RewardRunnerConfig
    from core_rl.loops.rl.reward_runner import NONFINITE, RewardRunner

    runner = RewardRunner(judge(endpoint), "judge", RewardRunnerConfig(on_error="value", error_value=0.0))
    result = runner.score([make_reward_input("ab"), make_reward_input("?")])
    runner.close()
    assert result.scores[1] == 0.0 and [f.kind for f in result.failures] == [NONFINITE]


class TestJudgeContract(RewardContract):
    plugin = core_rl_reward_remote.plugin
    name = "judge"
    distribution = "core-rl-reward-remote"
    options: ClassVar[dict[str, Any]] = {}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("abcde"), 0.5),
        (make_reward_input("x" * 12), 1.0),
    ]

    @pytest.fixture(autouse=True)
    def _use_endpoint(self, endpoint: ChatEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(type(self), "options", {"url": endpoint.url + "/v1", "prompt": "{response}"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompt": "{question}"}, r"reward.prompt: .*names \['question'\]; it may name prompt, response, answer"),
        ({"prompt": "{answer}"}, r"reward.answer_key: .*must name the row's column"),
        ({"score_pattern": r"\d+"}, r"reward.score_pattern: .*exactly one group"),
        ({"score_pattern": r"(\d+"}, r"reward.score_pattern: .*not a regular expression"),
        ({"min_score": 5, "max_score": 5}, r"reward.max_score: .*above min_score"),
        ({"url": "localhost:8000"}, r"reward.url: must be an http"),
    ],
)
def test_configuration_mistakes(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(options, JudgeConfig, path="reward")
