"""Library workers (core_rl_server_kit.worker): a worker process runs a stdlib adapter file
(here in core-rl's own interpreter, as another venv's would), episodes of several environments go
over one worker concurrently, and what goes wrong is one line naming the plugin: an adapter that
cannot open, an adapter that raises, a worker that dies, a worker that does not answer, an
interpreter or venv that is not there."""

from __future__ import annotations

import ast
import asyncio
import json
import sys
from pathlib import Path

import pytest
from core_rl.errors import ConfigError
from core_rl.rollout import Action
from core_rl_server_kit import worker as kit
from core_rl_server_kit.worker import WorkerFailed, WorkerSpec

ADAPTER = '''
import asyncio, os


class Counter:
    """Each episode counts its steps; "die" kills the worker, "slow" sleeps, "bad" raises."""

    def __init__(self, options):
        self.options, self.counts = options, {}

    async def rows(self, count):
        return [{"prompt": f"p{i}", "i": i} for i in range(count)]

    async def reset(self, episode, row):
        self.counts[episode] = 0
        return f"{self.options['greeting']} {row['prompt']}"

    async def step(self, episode, text, turn):
        if text == "die":
            os._exit(3)
        if text == "slow":
            await asyncio.sleep(30)
        if text == "bad":
            raise KeyError("no such thing")
        print("library noise on stdout")  # must not break the protocol
        self.counts[episode] += 1
        return [f"seen {text}", float(self.counts[episode]), text == "stop", {"turn": turn}]

    async def close(self, episode):
        self.counts.pop(episode)


async def open_adapter(options):
    if options.get("refuse"):
        raise ValueError("unknown environment id 'nope'")
    return Counter(options)
'''


def spec(tmp_path: Path, **options: object) -> WorkerSpec:
    path = tmp_path / "adapter.py"
    path.write_text(ADAPTER)
    return WorkerSpec(
        who="environment 'demo'",
        key="rollout.workflow.environment",
        python=sys.executable,
        adapter=str(path),
        options=json.dumps({"greeting": "hi", **options}),
        start_timeout_s=30,
        call_timeout_s=5,
    )


def test_the_worker_loop_imports_only_the_standard_library() -> None:
    tree = ast.parse(kit.LOOP_FILE.read_text())
    modules = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and (isinstance(n, ast.Import) or n.level == 0)
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert modules - {"__future__"} <= set(sys.stdlib_module_names)


def test_episodes_of_several_environments_share_one_worker(tmp_path: Path) -> None:
    the_spec = spec(tmp_path)

    async def episode(name: str, turns: int) -> list:
        env = kit.WorkerEnvironment(kit.shared_worker(the_spec))
        first = await env.reset({"prompt": name})
        results = [first]
        for turn in range(turns):
            results.append(tuple(await env.step(Action("stop" if turn == turns - 1 else "go", (), turn))))
        await env.close()
        return results

    async def both() -> list:
        return await asyncio.gather(episode("a", 3), episode("b", 1))

    a, b = asyncio.run(both())
    assert a[0] == "hi a" and [r[1] for r in a[1:]] == [1.0, 2.0, 3.0] and a[-1][2] is True
    assert a[1] == ("seen go", 1.0, False, {"turn": 0})
    assert b == ["hi b", ("seen stop", 1.0, True, {"turn": 0})]
    assert kit.shared_worker(the_spec) is kit.shared_worker(the_spec)
    kit.stop_workers()


def test_rows_come_from_the_adapter_once(tmp_path: Path) -> None:
    the_spec = spec(tmp_path)
    rows = kit.worker_rows(the_spec, count=3)
    assert rows == [{"prompt": "p0", "i": 0}, {"prompt": "p1", "i": 1}, {"prompt": "p2", "i": 2}]
    rows[0]["prompt"] = "changed"
    assert kit.worker_rows(the_spec, count=3)[0]["prompt"] == "p0"


def test_an_adapter_that_cannot_open_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"rollout.workflow.environment: environment 'demo' could not open: "
        r"ValueError: unknown environment id 'nope'",
    ):
        kit.Worker(spec(tmp_path, refuse=True))


def test_an_adapter_error_a_dead_worker_and_a_silent_one_are_one_line_each(tmp_path: Path) -> None:
    worker = kit.Worker(spec(tmp_path))
    try:
        env = kit.WorkerEnvironment(worker)

        async def go(text: str) -> object:
            await env.reset({"prompt": "x"})
            return await env.step(Action(text, (), 0))

        with pytest.raises(RuntimeError, match=r"^KeyError: 'no such thing'$"):
            asyncio.run(go("bad"))
        with pytest.raises(WorkerFailed, match=r"environment 'demo': its worker did not answer step within 5 s"):
            asyncio.run(go("slow"))
        with pytest.raises(
            WorkerFailed, match=r"environment 'demo': its worker .* failed: it exited \(exit status 3\)"
        ):
            asyncio.run(go("die"))
        with pytest.raises(WorkerFailed, match=r"it exited \(exit status 3\)"):
            worker.call("rows", count=1)  # every later request is refused at once
    finally:
        worker.stop()


def test_a_missing_interpreter_and_a_failed_venv_build_name_the_key(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"rollout.workflow.environment.python: no interpreter at '/no/python'"):
        kit.library_python("demo", "/no/python", [], "rollout.workflow.environment")
    with pytest.raises(ConfigError, match=r"rollout.workflow.environment: set requirements"):
        kit.library_python("demo", "", [], "rollout.workflow.environment")
    monkeypatch.setenv("CORE_RL_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("UV_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match=r"rollout.workflow.environment.requirements: demo's environment could not "
        r"be built: step 1 of demo \(-m pip install no-such-package-core-rl==0.0.1\) failed",
    ):
        kit.library_python("demo", "", ["no-such-package-core-rl==0.0.1"], "rollout.workflow.environment")
