"""The ``math`` reward: extract the final answer (:mod:`.extract`), then check it against the row's
reference answer with math-verify in worker processes, each item under a wall-time limit.

``score = 1.0`` if math-verify finds the extracted answer equivalent to the reference, else
``0.0`` (also when no answer is found, or verification runs past ``timeout_s``: that item's worker
is killed and replaced). Parts: ``answer_found`` (1 when an answer was extracted) and ``timeout``
(1 when the item's verification was killed).
"""

from __future__ import annotations

import multiprocessing
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from core_rl.errors import row_column
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput
from pebble import ProcessExpired, ProcessPool

from core_rl_reward_math.config import MathConfig
from core_rl_reward_math.extract import as_latex_answer, find_answer, parser_input
from core_rl_reward_math.verify import verify_pair, warm_up


def reference_answer(row: Mapping[str, Any], key: str) -> str:
    """The row's reference answer as a string; :class:`DataError` if missing or null."""
    value = row_column(row, key, reader="reward 'math'", key_path="reward.answer_key", holds="the reference answer")
    return value if isinstance(value, str) else str(value)


def _stop_pool(pool: ProcessPool) -> None:
    pool.stop()
    pool.join(timeout=10)


class MathReward(Reward):
    """See the module docstring. Thread-safe: concurrent :meth:`score` calls share the workers."""

    def __init__(self, config: MathConfig | None = None) -> None:
        self.config = config if config is not None else MathConfig()
        self._pool: ProcessPool | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def _workers(self) -> ProcessPool:
        with self._lock:
            if self._pool is None or not self._pool.active:
                # spawn, not fork: the trainer holds threads (torch, loggers) a fork would copy mid-state
                self._pool = ProcessPool(
                    max_workers=self.config.num_workers,
                    initializer=warm_up,
                    context=multiprocessing.get_context("spawn"),
                )
                self._finalizer = weakref.finalize(self, _stop_pool, self._pool)
            return self._pool

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        cfg = self.config
        golds = [as_latex_answer(reference_answer(item.row, cfg.answer_key)) for item in items]
        answers = [find_answer(item.response_text, cfg.extract) for item in items]
        scores = [0.0] * len(items)
        timeouts = [0.0] * len(items)
        pending = {
            i: self._workers().schedule(
                verify_pair, args=(golds[i], parser_input(*a), cfg.float_rounding, cfg.strict), timeout=cfg.timeout_s
            )
            for i, a in enumerate(answers)
            if a is not None
        }
        for i, future in pending.items():
            try:
                scores[i] = 1.0 if future.result() else 0.0
            except (FutureTimeout, ProcessExpired):  # past timeout_s (killed), or the worker died
                timeouts[i] = 1.0
        found = [0.0 if a is None else 1.0 for a in answers]
        voted = [None if a is None else a[1] for a in answers]
        return RewardScores(scores=scores, parts={"answer_found": found, "timeout": timeouts}, answers=voted)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores

    def close(self) -> None:
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._pool = None
