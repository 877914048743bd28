"""One HTTP service a reward calls (``remote``'s scoring service, ``judge``'s chat endpoint): a
shared connection pool with the auth header from the environment, and :meth:`HTTPService.post`,
which retries what retrying can fix.

A connection error, a timeout, HTTP 408/429 or a 5xx answer is retried up to ``max_retries`` times
after ``min(backoff_max_s, backoff_s * 2**attempt)`` seconds (or the server's ``Retry-After``); HTTP
401/403 is an error naming the token's variable, another 4xx an error at once.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from core_rl.errors import CoreRLError

from core_rl_reward_remote.config import HTTPServiceConfig

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The service could not answer (after retries, where retrying made sense)."""


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class HTTPService:
    """See the module docstring. ``words``: how errors name the reward (``reward 'judge'``).
    Thread-safe (one shared connection pool)."""

    def __init__(self, config: HTTPServiceConfig, words: str) -> None:
        self.config = cfg = config
        self.words = words
        headers = {}
        if cfg.auth_env is not None:
            token = os.environ.get(cfg.auth_env)
            if not token:
                raise CoreRLError(
                    f"{words}: environment variable {cfg.auth_env} (reward.auth_env) is not set; "
                    "export the service's token in it"
                )
            headers[cfg.auth_header] = f"{cfg.auth_scheme} {token}".strip()
        self.client = httpx.Client(
            headers=headers,
            timeout=cfg.timeout_s,
            limits=httpx.Limits(max_connections=cfg.max_concurrent_requests),
        )

    def post(self, url: str, payload: Any) -> httpx.Response:
        """The successful answer to ``POST url`` with the JSON ``payload`` (module docstring)."""
        cfg = self.config
        failures = []
        for attempt in range(cfg.max_retries + 1):
            delay = min(cfg.backoff_max_s, cfg.backoff_s * 2**attempt)
            try:
                response = self.client.post(url, json=payload)
            except httpx.TimeoutException:
                failures.append(f"no answer within {cfg.timeout_s} s")
            except httpx.TransportError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            else:
                if response.status_code in RETRY_STATUSES:
                    failures.append(f"HTTP {response.status_code}")
                    delay = _retry_after(response) or delay
                elif response.status_code in (401, 403):
                    hint = f"check the token in {cfg.auth_env}" if cfg.auth_env else "set reward.auth_env"
                    raise RemoteRewardError(
                        f"{self.words}: {url} refused the request (HTTP {response.status_code}); {hint}"
                    )
                elif response.is_error:
                    raise RemoteRewardError(
                        f"{self.words}: {url} answered HTTP {response.status_code}: {response.text[:300]}"
                    )
                else:
                    return response
            if attempt < cfg.max_retries:
                time.sleep(min(delay, cfg.backoff_max_s))
        raise RemoteRewardError(
            f"{self.words}: {url} failed {len(failures)} times ({'; '.join(failures)}); "
            "is the service up? (reward.max_retries, reward.timeout_s)"
        )

    def close(self) -> None:
        self.client.close()
