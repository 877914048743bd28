"""The ``remote`` reward against real HTTP servers on the loopback, started by the tests: batching,
concurrency, auth from the environment, and slow, failing and malformed services."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import core_rl_reward_remote.plugin
import pytest
from core_rl.config.loader import structure, to_plain
from core_rl.errors import ConfigError, CoreRLError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input
from core_rl.testing.recording_server import QuietHTTPServer
from core_rl_reward_remote.config import RemoteConfig
from core_rl_reward_remote.reward import RemoteReward, RemoteRewardError

TOKEN = "test-token-123"


class Service:
    """A reward service: score = len(response) / 10, part ``has_row`` = 1 if the row has ``answer``
    (``null`` otherwise: the part does not apply).

    Paths: ``/score``; ``/slow`` (the first request sleeps past the client's timeout);
    ``/flaky`` (HTTP 503 twice, then fine); ``/down`` (always 500); ``/busy`` (429 with Retry-After
    once); ``/auth`` (needs the bearer token); ``/garbage``; ``/short`` (one score too few)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    n = sum(1 for r in service.requests if r["path"] == self.path)
                    service.requests.append(
                        {"path": self.path, "items": body["items"], "auth": self.headers["Authorization"]}
                    )
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                try:
                    self.answer(body["items"], n)
                finally:
                    with service.lock:
                        service.in_flight -= 1

            def send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def answer(self, items: list[dict[str, Any]], n: int) -> None:
                scores = [len(i["response"]) / 10 for i in items]
                has_row = [1.0 if "answer" in i.get("row", {}) else None for i in items]
                ok = {"scores": scores, "parts": {"has_row": has_row}}
                path = self.path
                if path == "/slow" and n == 0:
                    time.sleep(5.0)
                if path == "/meet":
                    time.sleep(0.3)
                if (path == "/flaky" and n < 2) or path == "/down":
                    return self.send(503 if path == "/flaky" else 500, {"error": "overloaded"})
                if path == "/busy" and n == 0:
                    return self.send(429, {"error": "slow down"}, {"Retry-After": "0"})
                if path == "/auth" and self.headers["Authorization"] != f"Bearer {TOKEN}":
                    return self.send(401, {"error": "who are you"})
                if path == "/garbage":
                    return self.send(200, b"<html>not json</html>")
                if path == "/short":
                    return self.send(200, {"scores": scores[:-1]})
                return self.send(200, ok)

        self.server = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def calls(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    s = Service()
    yield s
    s.stop()


def _reward(service: Service, path: str, **options: Any) -> RemoteReward:
    options = {"url": service.url + path, "backoff_s": 0.01, "timeout_s": 5.0, **options}
    return RemoteReward(structure(options, RemoteConfig, path="reward"))


def _items(n: int) -> list[RewardInput]:
    return [make_reward_input("x" * i, {"answer": i} if i % 2 else {}) for i in range(n)]


class TestRemoteContract(RewardContract):
    """Contract against a service started for the class (the url is filled in per test)."""

    plugin = core_rl_reward_remote.plugin
    name = "remote"
    distribution = "core-rl-reward-remote"
    options: ClassVar[dict[str, Any]] = {}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("abcde"), 0.5),
        (make_reward_input(""), 0.0),
        (make_reward_input("x" * 12), 1.2),
    ]

    @pytest.fixture(autouse=True)
    def _use_service(self, service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(type(self), "options", {"url": service.url + "/score", "batch_size": 2})


def test_batches_in_order_with_parts_and_concurrency(service):
    reward = _reward(service, "/meet", batch_size=3, max_concurrent_requests=4)
    result = reward.score_with_parts(_items(10))
    reward.close()
    assert result.scores == [i / 10 for i in range(10)]
    assert result.parts == {"has_row": [1.0 if i % 2 else None for i in range(10)]}  # null: does not apply
    assert sorted(len(r["items"]) for r in service.calls("/meet")) == [1, 3, 3, 3]
    assert set(service.calls("/meet")[0]["items"][0]) == {"prompt", "response", "row", "finish_reason"}
    assert service.max_in_flight >= 2  # batches overlapped (each takes 0.3 s on the server)


def test_slow_service_times_out_then_succeeds_on_retry(service):
    reward = _reward(service, "/slow", timeout_s=2.0, max_retries=2)  # the retry's answer has 2 s, loaded or not
    assert reward.score(_items(3)) == [0.0, 0.1, 0.2]
    assert len(service.calls("/slow")) == 2  # the first attempt timed out


def test_failing_service_is_retried_with_backoff(service):
    reward = _reward(service, "/flaky", max_retries=3, backoff_s=0.05)
    start = time.monotonic()
    assert reward.score(_items(2)) == [0.0, 0.1]
    assert len(service.calls("/flaky")) == 3
    assert time.monotonic() - start >= 0.05 + 0.1  # two back-offs: 0.05 s, then 0.1 s


def test_retry_after_is_honoured(service):
    assert _reward(service, "/busy").score(_items(1)) == [0.0]
    assert len(service.calls("/busy")) == 2


def test_service_down_fails_after_retries_with_a_clear_error(service):
    reward = _reward(service, "/down", max_retries=2)
    with pytest.raises(RemoteRewardError, match=r"/down failed 3 times \(HTTP 500; HTTP 500; HTTP 500\)"):
        reward.score(_items(1))
    assert len(service.calls("/down")) == 3


def test_nothing_listening():
    reward = RemoteReward(RemoteConfig(url="http://127.0.0.1:9/score", max_retries=1, backoff_s=0.01))
    with pytest.raises(RemoteRewardError, match="failed 2 times .*ConnectError"):
        reward.score(_items(1))


def test_malformed_answers_are_errors(service):
    with pytest.raises(RemoteRewardError, match="not .*scores"):
        _reward(service, "/garbage").score(_items(2))
    with pytest.raises(RemoteRewardError, match="sent 1 scores for 2 items"):
        _reward(service, "/short").score(_items(2))


def test_token_comes_from_the_environment(service, monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", TOKEN)
    assert _reward(service, "/auth", auth_env="REWARD_TOKEN").score(_items(2)) == [0.0, 0.1]
    assert service.calls("/auth")[-1]["auth"] == f"Bearer {TOKEN}"
    monkeypatch.setenv("REWARD_TOKEN", "wrong")
    with pytest.raises(RemoteRewardError, match="HTTP 401.*check the token in REWARD_TOKEN"):
        _reward(service, "/auth", auth_env="REWARD_TOKEN").score(_items(1))
    monkeypatch.delenv("REWARD_TOKEN")
    with pytest.raises(CoreRLError, match="REWARD_TOKEN .* is not set"):
        _reward(service, "/auth", auth_env="REWARD_TOKEN")


def test_a_token_pasted_into_the_config_is_refused_without_echoing_it():
    with pytest.raises(ConfigError) as info:
        structure({"auth_env": "sk-live-abc.123"}, RemoteConfig, path="reward")
    message = str(info.value)
    assert "reward.auth_env: must be the NAME of an environment variable" in message
    assert "sk-live" not in message
    shown = to_plain(structure({"auth_env": "REWARD_TOKEN"}, RemoteConfig, path="reward"))
    assert shown["auth_env"] == "REWARD_TOKEN"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "127.0.0.1:80"}, "reward.url: must be an http:// or https:// URL"),
        ({"fields": ["response", "answer"]}, "reward.fields: must list some of"),
        ({"batch_size": 0}, "reward.batch_size: must be > 0"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        structure(options, RemoteConfig, path="reward")
