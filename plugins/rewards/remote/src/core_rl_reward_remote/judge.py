"""The ``judge`` reward: an LLM judges each response through an OpenAI-compatible chat endpoint
(vLLM, SGLang, an inference provider).

For each item, one ``POST {url}/chat/completions`` with ``model``, the messages ``[system?, user:
prompt.format(prompt=..., response=..., answer=row[answer_key])]``, ``temperature`` and
``max_tokens``; requests run ``max_concurrent_requests`` at a time and are retried as
:mod:`core_rl_reward_remote.http_service` says. From the reply's ``message.content`` the score is
``score_pattern``'s first group in its ``last`` (or ``first``) match, then

    reward = clip((score - min_score) / (max_score - min_score), 0, 1)

A reply with no match (or no number) scores NaN, which the reward runner treats as a failed item
(``reward_runner.on_error``: an error value, dropped, or the run stopped), and the part
``unparsed`` counts it (1; 0 otherwise); the part ``score`` holds the judge's raw number (``None``
when unparsed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput

from core_rl_reward_remote.config import JudgeConfig
from core_rl_reward_remote.http_service import HTTPService, RemoteRewardError

WORDS = "reward 'judge'"


def judge_messages(item: RewardInput, config: JudgeConfig) -> list[dict[str, str]]:
    """The chat messages that ask the judge about ``item``."""
    answer = item.row.get(config.answer_key) if config.answer_key is not None else None
    user = config.prompt.format(prompt=item.prompt_text, response=item.response_text, answer=answer)
    system = [{"role": "system", "content": config.system}] if config.system else []
    return [*system, {"role": "user", "content": user}]


def parse_score(text: str, config: JudgeConfig) -> float | None:
    """The judge's number in ``text`` (``score_pattern``'s group, ``score_match``), or ``None``."""
    matches = list(re.finditer(config.score_pattern, text))
    if not matches:
        return None
    chosen = matches[-1] if config.score_match == "last" else matches[0]
    try:
        value = float(chosen.group(1))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def scaled(score: float, config: JudgeConfig) -> float:
    """``clip((score - min_score) / (max_score - min_score), 0, 1)``."""
    return min(max((score - config.min_score) / (config.max_score - config.min_score), 0.0), 1.0)


class JudgeReward(Reward):
    """See the module docstring. Thread-safe (one shared connection pool)."""

    def __init__(self, config: JudgeConfig | None = None) -> None:
        self.config = config if config is not None else JudgeConfig()
        self.service = HTTPService(self.config, WORDS)
        self.endpoint = self.config.url.rstrip("/") + "/chat/completions"

    def _ask(self, item: RewardInput) -> str:
        cfg = self.config
        payload: dict[str, Any] = {
            "model": cfg.model,
            "messages": judge_messages(item, cfg),
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }
        response = self.service.post(self.endpoint, payload)
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RemoteRewardError(
                f"{WORDS}: {self.endpoint} answered {response.text[:200]!r}, not a chat completion ({exc!r})"
            ) from None
        return content if isinstance(content, str) else ""

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        workers = max(1, min(self.config.max_concurrent_requests, len(items)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
            replies = list(pool.map(self._ask, items))
        raw = [parse_score(reply, self.config) for reply in replies]
        scores = [math.nan if r is None else scaled(r, self.config) for r in raw]
        parts: dict[str, list[float | None]] = {"score": list(raw), "unparsed": [float(r is None) for r in raw]}
        return RewardScores(scores=scores, parts=parts)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores

    def close(self) -> None:
        self.service.close()
