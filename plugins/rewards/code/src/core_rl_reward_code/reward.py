"""The ``code`` reward: run the response's Python code against the row's tests in a sandbox
(:mod:`.sandbox`).

- ``assert`` mode: the tests (Python source, or a list of snippets) run after the solution in one
  sandboxed process (:mod:`.harness`); ``passed / total`` snippets pass.
- ``stdio`` mode: the solution runs once per ``{input, output}`` case, with ``input`` on stdin;
  a case passes when it exits 0 and its stdout equals ``output`` (trailing whitespace of each line
  and trailing blank lines ignored).

``score = 1.0`` if every test passes, else ``0.0`` (``passed / total`` with ``partial_credit``).
Parts: ``tests_passed`` (fraction of tests passed) and ``timeout`` (1 if any run hit the wall-clock
limit).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from core_rl.errors import DataError, row_column
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput

from core_rl_reward_code import harness
from core_rl_reward_code.config import CodeConfig
from core_rl_reward_code.sandbox import require_sandbox, run_sandboxed

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, how: str = "last_block") -> str:
    """The last fenced code block (preferring ``python``/``py`` ones) or, without one, ``text``."""
    if how == "raw":
        return text
    blocks = _FENCE.findall(text)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = python or [body for _, body in blocks]
    return chosen[-1] if chosen else text


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


class CodeReward(Reward):
    """See the module docstring."""

    def __init__(self, config: CodeConfig | None = None) -> None:
        self.config = config if config is not None else CodeConfig()
        require_sandbox()

    def tests_of(self, row: Mapping[str, Any]) -> tuple[str, list[Any]]:
        """``(mode, tests)`` of a row; :class:`DataError` if missing or malformed."""
        key = self.config.tests_key
        tests = row_column(row, key, reader="reward 'code'", key_path="reward.tests_key", holds="the tests")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list):
            raise DataError(f"reward 'code': the row's {key!r} must be a string or a list, got {type(tests).__name__}")
        mode = self.config.mode
        if mode == "auto":
            mode = "stdio" if tests and all(isinstance(t, Mapping) for t in tests) else "assert"
        expected = Mapping if mode == "stdio" else str
        if not all(isinstance(t, expected) for t in tests) or (
            mode == "stdio" and not all({"input", "output"} <= set(t) for t in tests)
        ):
            what = "{input, output} mappings" if mode == "stdio" else "strings of Python code"
            raise DataError(f"reward 'code': in {mode} mode the row's {key!r} must hold {what}")
        return mode, tests

    def _run_asserts(self, code: str, tests: list[str]) -> tuple[int, int, bool]:
        result = run_sandboxed(
            [sys.executable, "-I", harness.__file__, "solution.py", "tests.json", "{verdict_fd}"],
            {"solution.py": code, "tests.json": json.dumps(tests)},
            self.config.sandbox,
            verdict_fd=True,
        )
        try:
            verdict = json.loads(result.verdict)
            return int(verdict["passed"]), len(tests), result.timed_out
        except (ValueError, KeyError, TypeError):  # killed, or exited before the harness reported
            return 0, len(tests), result.timed_out

    def _run_stdio(self, code: str, cases: list[Mapping[str, Any]]) -> tuple[int, int, bool]:
        passed, timed_out = 0, False
        for case in cases:
            result = run_sandboxed(
                [sys.executable, "-I", "solution.py"],
                {"solution.py": code},
                self.config.sandbox,
                stdin=str(case["input"]),
            )
            timed_out |= result.timed_out
            ok = result.exit_code == 0 and not result.timed_out
            passed += ok and _normalise_output(result.stdout) == _normalise_output(str(case["output"]))
        return passed, len(cases), timed_out

    def _score_one(self, item: RewardInput) -> tuple[float, float, float]:
        mode, tests = self.tests_of(item.row)
        code = extract_code(item.response_text, self.config.extract)
        if not tests:
            return 1.0, 1.0, 0.0
        run = self._run_stdio if mode == "stdio" else self._run_asserts
        passed, total, timed_out = run(code, tests)
        fraction = passed / total
        score = fraction if self.config.partial_credit else float(passed == total)
        return score, fraction, float(timed_out)

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        for item in items:  # data errors first, before any run
            self.tests_of(item.row)
        with ThreadPoolExecutor(max_workers=self.config.num_workers, thread_name_prefix="code-reward") as pool:
            results = list(pool.map(self._score_one, items))
        return RewardScores(
            scores=[r[0] for r in results],
            parts={"tests_passed": [r[1] for r in results], "timeout": [r[2] for r in results]},
        )

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores
