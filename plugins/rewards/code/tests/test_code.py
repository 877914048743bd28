"""The ``code`` reward: conformance, assert and stdio tests, limits, and escape attempts from the
sandbox (network, fork bomb, writes outside, the trainer's environment), each of which must fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import core_rl_reward_code.plugin
import pytest
from core_rl.config.loader import structure
from core_rl.errors import DataError
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input
from core_rl_reward_code.config import CodeConfig
from core_rl_reward_code.reward import CodeReward, extract_code
from core_rl_reward_code.sandbox import SandboxLimits, run_sandboxed, sandbox_problem

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]}


class TestCodeContract(RewardContract):
    plugin = core_rl_reward_code.plugin
    name = "code"
    distribution = "core-rl-reward-code"
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("Here:\n" + ADD, ADD_TESTS), 1.0),
        (make_reward_input("def add(a, b):\n    return a - b", ADD_TESTS), 0.0),
        (make_reward_input("print(int(input()) * 2)", {"tests": [{"input": "21\n", "output": "42\n"}]}), 1.0),
    ]


class TestCodePartialContract(RewardContract):
    plugin = core_rl_reward_code.plugin
    name = "code"
    distribution = "core-rl-reward-code"
    options: ClassVar[dict[str, Any]] = {"partial_credit": True, "tests_key": "cases", "sandbox": {"timeout_s": 20}}
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("def add(a, b):\n    return int(a) + int(b)", {"cases": ADD_TESTS["tests"]}), 2 / 3),
        (
            make_reward_input(
                "import sys\nn = int(sys.stdin.read())\nprint(n if n > 0 else 0)",
                {"cases": [{"input": "5", "output": "5"}, {"input": "-3", "output": "-3"}]},
            ),
            0.5,
        ),
    ]


def _reward(**options: Any) -> CodeReward:
    return CodeReward(structure(options, CodeConfig, path="reward"))


def _score(code: str, tests: Any, **options: Any) -> tuple[float, dict[str, float]]:
    result = _reward(**options).score_with_parts([make_reward_input(code, {"tests": tests})])
    return result.scores[0], {k: v[0] for k, v in result.parts.items()}


def test_extract_code():
    text = "intro\n```\nfirst\n```\nthen\n```python\nsecond\n```\n```py\nthird\n```\n```text\nlast\n```"
    assert extract_code(text) == "third\n"
    assert extract_code("```js\nx\n```") == "x\n"
    assert extract_code("plain code") == "plain code"
    assert extract_code(text, "raw") == text


def test_tests_as_one_source_string_and_main_blocks_do_not_run():
    code = "def f():\n    return 7\nif __name__ == '__main__':\n    raise SystemExit(1)"
    assert _score(code, "assert f() == 7\nassert f() + 1 == 8") == (1.0, {"tests_passed": 1.0, "timeout": 0.0})


def test_exiting_early_does_not_pass():
    for cheat in ("import sys\nsys.exit(0)", "import os\nos._exit(0)"):
        assert _score(cheat, ["assert False"])[0] == 0.0


def test_stdio_output_comparison_ignores_trailing_whitespace():
    cases = [{"input": "3\n", "output": "1\n2\n3"}, {"input": "1", "output": "1\n\n"}]
    assert _score("for i in range(int(input())):\n    print(i + 1, '  ')", cases)[0] == 1.0
    assert _score("print(0)", cases)[0] == 0.0


def test_wall_clock_timeout_kills_and_is_reported():
    score, parts = _score("import time\ntime.sleep(60)", ["pass"], sandbox={"timeout_s": 1.0})
    assert score == 0.0 and parts["timeout"] == 1.0


def test_cpu_time_limit():
    result = run_sandboxed(["python3", "-c", "while True: pass"], {}, SandboxLimits(cpu_s=1, timeout_s=60))
    # only the CPU limit can end this loop before the 60 s wall clock (unshare reports the
    # child's death by signal as exit status 1)
    assert not result.timed_out and result.exit_code != 0


def test_memory_limit():
    code = "try:\n    x = bytearray(2 << 30)\n    print('allocated')\nexcept MemoryError:\n    print('refused')"
    result = run_sandboxed(["python3", "-c", code], {}, SandboxLimits(memory_mb=512))
    assert result.stdout.strip() == "refused"


def test_output_size_limit():
    result = run_sandboxed(
        ["python3", "-c", "import sys\nwhile True: sys.stdout.write('x' * 4096)"], {}, SandboxLimits(max_output_kb=64)
    )
    assert result.exit_code != 0 and not result.timed_out
    assert len(result.stdout) == 64 << 10


def test_missing_or_malformed_tests_are_data_errors():
    reward = _reward()
    with pytest.raises(DataError, match=r"no 'tests' column \(its keys: 'q'\); set reward.tests_key to the column"):
        reward.score([make_reward_input("x", {"q": 1})])
    with pytest.raises(DataError, match=r"reward 'code': the data row's 'tests' is null"):
        reward.score([make_reward_input("x", {"tests": None})])
    with pytest.raises(DataError, match="must be a string or a list"):
        reward.score([make_reward_input("x", {"tests": 3})])
    with pytest.raises(DataError, match=r"stdio mode .* \{input, output\} mappings"):
        _reward(mode="stdio").score([make_reward_input("x", {"tests": ["assert 1"]})])


# -- escape attempts: each test's code reports success through the harness, so a score of 1 means
#    the sandbox let it out; each also has a control showing the attempt works outside it


def _escape_score(code: str, **options: Any) -> float:
    return _score(textwrap.dedent(code), ["assert ESCAPED, ESCAPED"], **options)[0]


def test_no_network_not_even_the_host_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"""
        import socket
        ESCAPED = []
        for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("pypi.org", 443)]:
            try:
                socket.create_connection((host, port), timeout=3).close()
                ESCAPED.append(host)
            except OSError:
                pass
        """
        assert _escape_score(code) == 0.0
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached the host's listening socket
            server.accept()
        socket.create_connection(("127.0.0.1", port), timeout=3).close()  # control: reachable outside
        conn, _ = server.accept()
        conn.close()


def test_fork_bomb_is_contained_and_leaves_no_process():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    score, parts = _score(code, ["assert True"], sandbox={"timeout_s": 3.0, "max_processes": 16})
    assert score == 0.0 and parts["timeout"] == 1.0
    assert _sandbox_processes() == []
    assert subprocess.run(["true"], timeout=10).returncode == 0  # this side can still fork


def _sandbox_processes() -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if "core-rl-code-" in os.readlink(proc / "cwd"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_writes_outside_the_work_directory_fail(tmp_path):
    home = Path.home()
    targets = [tmp_path / "escaped.txt", Path("/tmp") / f"escaped-{os.getpid()}.txt", home / ".escaped-core-rl"]
    targets.append(Path("/dev/shm") / f"escaped-{os.getpid()}")
    code = f"""
    ESCAPED = []
    for path in {[str(t) for t in targets]!r}:
        try:
            with open(path, "w") as f:
                f.write("x")
            ESCAPED.append(path)
        except OSError:
            pass
    with open("inside.txt", "w") as f:  # the private work directory is writable
        f.write("ok")
    assert open("inside.txt").read() == "ok"
    """
    assert _escape_score(code) == 0.0
    assert not [t for t in targets if t.exists()]
    (tmp_path / "control.txt").write_text("x")  # writable from outside


def test_the_trainers_environment_cannot_be_read(monkeypatch):
    secret = f"core-rl-secret-{os.getpid()}"
    monkeypatch.setenv("CORE_RL_TEST_SECRET", secret)  # what a subprocess would inherit
    # a process started with the secret in its environment, standing for the trainer process
    trainer = subprocess.Popen(["sleep", "60"], env={**os.environ})
    try:
        code = f"""
        import os
        ESCAPED = [k for k, v in os.environ.items() if "{secret}" in v]
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["{trainer.pid}", "{os.getpid()}"]:
            try:
                with open(f"/proc/{{pid}}/environ", "rb") as f:
                    if b"{secret}" in f.read():
                        ESCAPED.append(pid)
            except OSError:
                pass
        """
        assert _escape_score(code) == 0.0
        assert secret.encode() in Path(f"/proc/{trainer.pid}/environ").read_bytes()  # control: readable outside
    finally:
        trainer.kill()
        trainer.wait(timeout=10)


def test_concurrent_sandboxes_never_reap_each_other():
    """Each run kills what is left in its own PID namespace when it ends; a namespace's identity is
    recycled once it dies, so a run that looked it up by number alone could kill a newer sandbox
    that got the same one (seen under load as a correct program scoring 0)."""
    from concurrent.futures import ThreadPoolExecutor

    from core_rl_reward_code.sandbox import SandboxLimits, run_sandboxed

    def run(i: int) -> str:
        program = f"import time; time.sleep(0.05 * ({i} % 4)); print({i})"
        return run_sandboxed([sys.executable, "-I", "-c", program], {}, SandboxLimits(timeout_s=60)).stdout

    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(run, range(48)))
    assert outputs == [f"{i}\n" for i in range(48)]
