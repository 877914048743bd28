"""How :func:`core_rl_ray.group.call` turns Ray's answers into a result or one :class:`ActorLost`
message. A node that is only temporarily unreachable, and then answers again, cannot be produced on
demand with a real cluster, so Ray's ``get`` and ``nodes`` are replaced here by scripted answers;
the real cluster's lost node and killed actors are in ``test_ray_runs.py``."""

from __future__ import annotations

import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from core_rl_ray.group import ActorLost, Member, call  # noqa: E402
from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

NODE = "c30eb32d6234" + "0" * 44
WHERE = {"pid": 42, "node_ip": "10.0.0.2", "hostname": "worker-1", "node_id": NODE}


class _Method:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any) -> str:
        self.calls.append(self.name)
        return f"ref-{len(self.calls)}"


class _Handle:
    """An actor handle whose every method call is recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.calls, name)


def _unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("RpcError: failed to connect to the raylet", None)


@pytest.fixture
def member() -> Member:
    return Member(name="run-1/rank-1", handle=_Handle(), where=dict(WHERE))


def _script(monkeypatch: pytest.MonkeyPatch, answers: list[Any], *, node_alive: bool = True) -> None:
    """``ray.get`` gives ``answers`` in turn (an exception is raised); ``ray.nodes`` lists the node."""

    def get(ref: str, timeout: float) -> Any:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": NODE, "Alive": node_alive}])


def test_a_query_asks_again_while_the_actor_is_temporarily_unavailable(monkeypatch, member) -> None:
    _script(monkeypatch, [_unavailable(), _unavailable(), 0])
    assert call(member, "poll", timeout=30, query=True) == 0
    assert member.handle.calls == ["poll", "poll", "poll"]


def test_a_call_with_side_effects_is_not_sent_twice(monkeypatch, member) -> None:
    _script(monkeypatch, [_unavailable(), "started"])
    with pytest.raises(ActorLost, match=r"stopped answering start\(\) .*its node is probably lost") as err:
        call(member, "start", ["argv"], timeout=30)
    assert member.handle.calls == ["start"]
    assert "actor run-1/rank-1 (pid 42 on node 10.0.0.2, worker-1, id c30eb32d6234)" in str(err.value)


def test_a_node_declared_dead_is_named_as_lost(monkeypatch, member) -> None:
    _script(monkeypatch, [_unavailable()], node_alive=False)
    with pytest.raises(ActorLost, match=r"is gone: its node was lost \(Ray declared it dead\)"):
        call(member, "poll", timeout=30, query=True)
    assert member.handle.calls == ["poll"]


def test_an_actor_unavailable_past_the_timeout_is_lost_within_it(monkeypatch, member) -> None:
    _script(monkeypatch, [_unavailable()])
    started = time.monotonic()
    with pytest.raises(ActorLost, match=r"stopped answering poll\(\)"):
        call(member, "poll", timeout=1.5, query=True)
    assert 1.4 < time.monotonic() - started < 3.0
    assert len(member.handle.calls) >= 2


def test_a_killed_actor_on_a_live_node_died(monkeypatch, member) -> None:
    _script(monkeypatch, [ActorDiedError()])
    with pytest.raises(ActorLost, match=r"actor run-1/rank-1 .* died: "):
        call(member, "poll", timeout=30, query=True)
    assert member.handle.calls == ["poll"]
