"""The ``remote`` reward: POST batches of samples to an HTTP reward service.

Request (one per ``batch_size`` items, up to ``max_concurrent_requests`` at once)::

    POST <url>   {"items": [{"prompt": ..., "response": ..., "row": {...}, "finish_reason": ...}, ...]}

Response: ``{"scores": [s_0, ...]}`` (one number per item, in order), optionally with
``"parts": {"name": [v_0, ...], ...}`` reported as ``reward/<name>/mean`` (``null``: the part does
not apply to that item, left out of its statistics).

Each request has ``timeout_s``; a connection error, a timeout, HTTP 429 or a 5xx status is retried
up to ``max_retries`` times after ``min(backoff_max_s, backoff_s * 2**attempt)`` seconds (or the
server's ``Retry-After``). Another 4xx status, a malformed body or the wrong number of scores is
a :class:`RemoteRewardError` at once. The token comes from the environment variable named by
``auth_env``, read when the reward is built; it is never part of the configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput

from core_rl_reward_remote.config import RemoteConfig
from core_rl_reward_remote.http_service import HTTPService, RemoteRewardError

__all__ = ["RemoteReward", "RemoteRewardError"]


def _payload(item: RewardInput, fields: Sequence[str]) -> dict[str, Any]:
    values = {
        "prompt": item.prompt_text,
        "response": item.response_text,
        "row": dict(item.row),
        "finish_reason": item.finish_reason,
        "prompt_ids": list(item.prompt_ids),
        "response_ids": list(item.response_ids),
        "info": dict(item.info),
        "workflow_reward": item.workflow_reward,
    }
    return {name: values[name] for name in fields}


class RemoteReward(Reward):
    """See the module docstring. Thread-safe (one shared connection pool)."""

    def __init__(self, config: RemoteConfig | None = None) -> None:
        self.config = config if config is not None else RemoteConfig()
        self.service = HTTPService(self.config, "reward 'remote'")

    def _post(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        return self._parse(self.service.post(self.config.url, {"items": batch}), len(batch))

    def _parse(self, response: httpx.Response, expected: int) -> dict[str, Any]:
        url = self.config.url
        try:
            body = response.json()
            scores = [float(s) for s in body["scores"]]
            parts = {str(k): [None if x is None else float(x) for x in v] for k, v in body.get("parts", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RemoteRewardError(
                f"reward 'remote': {url} answered {response.text[:200]!r}, not "
                f'{{"scores": [numbers], "parts": {{name: [numbers or null]}}}} ({exc})'
            ) from None
        for name, values in {"scores": scores, **parts}.items():
            if len(values) != expected:
                raise RemoteRewardError(f"reward 'remote': {url} sent {len(values)} {name} for {expected} items")
        return {"scores": scores, "parts": parts}

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        cfg = self.config
        payload = [_payload(item, cfg.fields) for item in items]
        batches = [payload[i : i + cfg.batch_size] for i in range(0, len(payload), cfg.batch_size)]
        with ThreadPoolExecutor(max_workers=cfg.max_concurrent_requests, thread_name_prefix="remote-reward") as pool:
            results = list(pool.map(self._post, batches))
        scores = [s for r in results for s in r["scores"]]
        names = {name for r in results for name in r["parts"]}
        parts = {n: [v for r in results for v in r["parts"].get(n, [None] * len(r["scores"]))] for n in names}
        return RewardScores(scores=scores, parts=parts)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores

    def close(self) -> None:
        self.service.close()
