"""Calling the reward: concurrent calls, each with a timeout, and per-item error handling.

:class:`RewardRunner` splits a step's items into calls of ``reward_runner.items_per_call`` items and
runs up to ``num_workers`` calls at once. A call that raises, or runs longer than ``timeout_s`` from
its start, fails every item in it; a score that is NaN, inf or not a number fails that item. Each
failed item gets ``on_error``: ``value`` (scored ``error_value``), ``drop`` (left out of the step) or
``stop`` (:class:`~core_rl.loops.errors.RewardError`). A wrong number of scores always stops.

Every call counts in :data:`core_rl.plugins.tally.PLUGIN_TALLY` (``plugins/reward.<name>/calls``,
``timeouts``, ``errors``); the wait for a step's calls is registered with the progress watchdog.

Python cannot kill a thread: a call that timed out keeps its worker thread until it returns, and a
fresh worker takes its place. The workers are daemon threads, so a reward that never returns
cannot keep the process from exiting (``concurrent.futures.ThreadPoolExecutor`` joins its threads
at exit). Too many such stuck calls at once stop the run.
"""

from __future__ import annotations

import json
import math
import numbers
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import attrs

from core_rl.builtin.loggers import truncate_jsonl
from core_rl.config.schema import RewardRunnerConfig
from core_rl.errors import warn
from core_rl.interfaces import Reward, RewardScores
from core_rl.loops.errors import RewardError
from core_rl.plugins.attribution import built_by
from core_rl.plugins.tally import PLUGIN_TALLY
from core_rl.protocol import RewardInput
from core_rl.reliability.progress import PROGRESS

#: kinds of item failures, as they appear in metrics and the error log
EXCEPTION, TIMEOUT, NONFINITE, NOT_A_NUMBER = "exception", "timeout", "nonfinite", "not_a_number"
FAILURE_KINDS = (EXCEPTION, TIMEOUT, NONFINITE, NOT_A_NUMBER)

#: more calls than this still running after their timeout means the reward hangs for good
MAX_STUCK_CALLS = 64


@attrs.define
class ItemFailure:
    """Item ``index`` of the scored list failed: ``kind`` is one of :data:`FAILURE_KINDS`,
    ``error`` says what happened."""

    index: int
    kind: str
    error: str


@attrs.define
class ScoreResult:
    """``scores[i]``: the score of item ``i`` (``error_value`` for a failed item under
    ``on_error: value``), or ``None`` for an item dropped under ``on_error: drop``. ``parts``: the
    reward's named per-item values (:meth:`core_rl.interfaces.Reward.score_with_parts`), ``None``
    for an item whose call failed (its failure is counted as such, not as a part). ``answers``: the
    final answers the reward read (``RewardScores.answers``), or ``None`` when it reads none."""

    scores: list[float | None]
    failures: list[ItemFailure]
    parts: dict[str, list[float]] = attrs.field(factory=dict)
    answers: list[str | None] | None = None

    @property
    def kept(self) -> list[int]:
        """Indices of the items that stay in the step."""
        return [i for i, s in enumerate(self.scores) if s is not None]


class _Call:
    """One ``Reward.score`` call: its items' indices, its future and when a worker started it."""

    def __init__(self, indices: range, fn: Callable[[], Any]) -> None:
        self.indices = indices
        self.fn = fn
        self.future: Future[Any] = Future()
        self.started: float | None = None
        self.abandoned = False


class _DaemonPool:
    """``size`` daemon worker threads running :class:`_Call` s from a queue."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._stuck: list[_Call] = []
        self._spawned = 0
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        self._spawned += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._spawned}", daemon=True).start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            if not call.future.set_running_or_notify_cancel():
                continue
            call.started = time.monotonic()
            try:
                result = call.fn()
            except BaseException as exc:
                call.future.set_exception(exc)
            else:
                call.future.set_result(result)
            if call.abandoned:  # a replacement took this thread's place while it was stuck
                return

    def submit(self, call: _Call) -> None:
        self._queue.put(call)

    def abandon(self, call: _Call) -> None:
        """``call`` ran past its timeout: leave its thread to it and start a replacement."""
        call.abandoned = True
        self._stuck.append(call)
        self._spawn()

    def stuck(self) -> int:
        """Calls still running after their timeout."""
        self._stuck = [c for c in self._stuck if not c.future.done()]
        return len(self._stuck)

    def close(self) -> None:
        for _ in range(self.size):
            self._queue.put(None)


def _part_value(value: Any) -> float | None:
    """A reward part's value as a float (NaN when it is not a finite number); ``None`` stays
    ``None`` (the part does not apply to the item)."""
    if value is None:
        return None
    score, _kind, _error = _as_score(value)
    return math.nan if score is None else score


def _as_score(value: Any) -> tuple[float | None, str, str]:
    """``(score, "", "")`` for a finite number, else ``(None, kind, error)``."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensor or array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, NOT_A_NUMBER, f"score is not a number: {type(value).__name__} {value!r:.80}"
    score = float(value)
    if not math.isfinite(score):
        return None, NONFINITE, f"score is {score}"
    return score, "", ""


def describe_item(item: RewardInput, limit: int = 80) -> str:
    """A short description of an item for error messages: its prompt and response texts."""
    return f"prompt {item.prompt_text[:limit]!r}, response {item.response_text[:limit]!r}"


class RewardRunner:
    """Scores items with ``reward`` as ``config`` says (see the module docstring); ``name`` is the
    reward's registered name; messages name the reward with its distribution when
    :func:`core_rl.plugins.components.build_component` built it."""

    def __init__(self, reward: Reward, name: str, config: RewardRunnerConfig) -> None:
        self.reward = reward
        self.name = name
        self.words = built_by(reward, f"reward {name!r}")
        #: its metric keys' part in :mod:`core_rl.plugins.tally` (``plugins/reward.<name>/...``)
        self.metric = f"reward.{name or type(reward).__name__}"
        self.config = config
        self._pool = _DaemonPool(config.num_workers, f"reward-{name}")

    def score(self, items: Sequence[RewardInput], *, step: int = 0) -> ScoreResult:
        """Score ``items``; ``step`` is only used in messages. Raises
        :class:`~core_rl.loops.errors.RewardError` as the module docstring says."""
        if not items:
            return ScoreResult([], [])
        size = self.config.items_per_call or len(items)
        calls = [
            _Call(range(start, min(start + size, len(items))), self._bind(items[start : start + size]))
            for start in range(0, len(items), size)
        ]
        for call in calls:
            self._pool.submit(call)
        self._wait(calls)
        scores: list[float | None] = [None] * len(items)
        failures: list[ItemFailure] = []
        parts: dict[str, list[float | None]] = {}
        answers: list[str | None] = [None] * len(items)
        gave_answers = False
        for call in calls:
            gave_answers |= self._collect(call, scores, failures, parts, answers)
        result = self._apply_policy(items, scores, failures, step)
        result.parts = parts
        result.answers = answers if gave_answers else None
        return result

    def _bind(self, chunk: Sequence[RewardInput]) -> Callable[[], Any]:
        chunk = list(chunk)
        return lambda: self.reward.score_with_parts(chunk)

    def _wait(self, calls: list[_Call]) -> None:
        """Until every call finished or ran past ``timeout_s`` (those are abandoned); the wait is
        registered as a call in flight for the progress watchdog."""
        with PROGRESS.call(f"{self.words}: score ({len(calls)} calls)"):
            self._wait_for(calls)

    def _wait_for(self, calls: list[_Call]) -> None:
        timeout = self.config.timeout_s
        pending = list(calls)
        while pending:
            now = time.monotonic()
            still = []
            for call in pending:
                if call.future.done():
                    continue
                if call.started is not None and now - call.started > timeout:
                    self._pool.abandon(call)
                    continue
                still.append(call)
            pending = still
            if not pending:
                break
            deadlines = [c.started + timeout for c in pending if c.started is not None]
            wait_s = min(0.1, max(0.001, min(deadlines) - now)) if deadlines else 0.01
            wait([c.future for c in pending], timeout=wait_s, return_when=FIRST_COMPLETED)
        stuck = self._pool.stuck()
        if stuck > MAX_STUCK_CALLS:
            raise RewardError(
                f"{self.words}: {stuck} calls are still running after their timeout "
                f"(reward_runner.timeout_s={timeout:g}); the reward hangs. Fix the reward or raise the timeout."
            )

    def _collect(
        self,
        call: _Call,
        scores: list[float | None],
        failures: list[ItemFailure],
        parts: dict[str, list[float]],
        answers: list[str | None],
    ) -> bool:
        """Record ``call``'s scores, failures, parts and answers; whether it gave answers."""
        if call.abandoned:
            error = f"score did not return within {self.config.timeout_s:g} s (reward_runner.timeout_s)"
            failures.extend(ItemFailure(i, TIMEOUT, error) for i in call.indices)
            PLUGIN_TALLY.record(self.metric, self.words, timeouts=1, what=error, said=True)
            return False
        exc = call.future.exception()
        if exc is not None:
            error = f"{type(exc).__name__}: {exc}"
            failures.extend(ItemFailure(i, EXCEPTION, error) for i in call.indices)
            PLUGIN_TALLY.record(self.metric, self.words, errors=1, said=True)
            return False
        PLUGIN_TALLY.record(self.metric, self.words, said=True)
        result = call.future.result()
        named = result.parts if isinstance(result, RewardScores) else {}
        given = result.answers if isinstance(result, RewardScores) else None
        if isinstance(result, RewardScores):
            result = result.scores
        try:
            values = list(result)
        except TypeError:
            values = None
        if values is None or len(values) != len(call.indices):
            got = f"{len(values)} scores" if values is not None else f"{type(result).__name__} {result!r:.80}"
            raise RewardError(
                f"{self.words} returned {got} for {len(call.indices)} items; Reward.score must "
                "return one score per item, in order"
            )
        for name, part in named.items():
            size = len(part) if hasattr(part, "__len__") else None
            if size != len(call.indices):
                got = f"{size} values" if size is not None else f"a {type(part).__name__}"
                raise RewardError(
                    f"{self.words} returned part {name!r} with {got} for {len(call.indices)} items; "
                    "RewardScores.parts holds one value per item of each part, in order"
                )
        for i, value in zip(call.indices, values):
            score, kind, error = _as_score(value)
            if score is None:
                failures.append(ItemFailure(i, kind, error))
            else:
                scores[i] = score
        for name, part in named.items():
            column = parts.setdefault(name, [None] * len(answers))
            for i, value in zip(call.indices, part):
                column[i] = _part_value(value)
        if given is None:
            return False
        if len(given) != len(call.indices) or any(a is not None and not isinstance(a, str) for a in given):
            raise RewardError(
                f"{self.words} returned answers {list(given)!r:.120} for {len(call.indices)} items; "
                "RewardScores.answers holds one str (or None) per item, in order"
            )
        for i, answer in zip(call.indices, given):
            answers[i] = answer
        return True

    def _apply_policy(
        self, items: Sequence[RewardInput], scores: list[float | None], failures: list[ItemFailure], step: int
    ) -> ScoreResult:
        cfg = self.config
        if failures and cfg.on_error == "stop":
            first = failures[0]
            raise RewardError(
                f"{self.words} failed on item {first.index} of step {step} "
                f"({describe_item(items[first.index])}): {first.error}"
                + (f" (and {len(failures) - 1} more items)" if len(failures) > 1 else "")
                + "; reward_runner.on_error=stop ends the run (value or drop continue past such items)"
            )
        fraction = len(failures) / len(items)
        if fraction > cfg.max_error_fraction:
            kinds = sorted({f.kind for f in failures})
            raise RewardError(
                f"{self.words} failed on {len(failures)} of {len(items)} items of step {step} "
                f"({', '.join(kinds)}; first: {failures[0].error}), more than "
                f"reward_runner.max_error_fraction={cfg.max_error_fraction:g}; the reward looks broken"
            )
        if cfg.on_error == "value":
            for f in failures:
                scores[f.index] = cfg.error_value
        return ScoreResult(scores, failures)

    def close(self) -> None:
        self._pool.close()


class RewardErrorLog:
    """Records failed items: one JSON line each in ``path`` (step, item index, kind, error, prompt,
    response), a one-line warning per step on stderr, and the counts as metrics. ``total`` counts
    every failed item of the run (saved in checkpoints)."""

    def __init__(self, path: Path, reward_name: str, config: RewardRunnerConfig) -> None:
        self.path = path
        self.reward_name = reward_name
        self.config = config
        self.total = 0

    def start(self, resume_step: int | None) -> None:
        """Drop the records of steps after ``resume_step`` (they will be scored again)."""
        if resume_step is not None:
            truncate_jsonl(self.path, resume_step)

    def record(self, step: int, items: Sequence[RewardInput], result: ScoreResult) -> dict[str, float]:
        """Write ``result``'s failures; return ``reward/errors`` (this step), ``reward/errors_total``,
        ``reward/dropped`` and ``reward/errors_<kind>`` for each kind that occurred."""
        failures = result.failures
        self.total += len(failures)
        metrics = {
            "reward/errors": float(len(failures)),
            "reward/errors_total": float(self.total),
            "reward/dropped": float(len(items) - len(result.kept)),
        }
        if not failures:
            return metrics
        counts = Counter(f.kind for f in failures)
        metrics.update({f"reward/errors_{kind}": float(n) for kind, n in counts.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for failure in failures:
                item = items[failure.index]
                record = {
                    "step": step,
                    "item": failure.index,
                    "kind": failure.kind,
                    "error": failure.error,
                    "prompt": item.prompt_text,
                    "response": item.response_text,
                }
                f.write(json.dumps(record) + "\n")
        what = f"scored {self.config.error_value:g}" if self.config.on_error == "value" else "dropped from the step"
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items()))
        warn(
            f"step {step}: reward {self.reward_name!r} failed on {len(failures)} of {len(items)} "
            f"items ({kinds}; first: {failures[0].error}); they were {what} "
            f"(reward_runner.on_error={self.config.on_error}); details in {self.path}"
        )
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total = int(state.get("total", 0))
