"""The agent: plain OpenAI client code, trained by pointing it at core-rl's proxy.

It asks the model the question, runs the calculator itself, sends the result back as a ``tool``
message and takes the model's next reply as the answer. Its reward is the answer's score against
the calculator's result (:func:`proxy_task.score`), returned to the workflow (in-process) or posted to the
proxy (as a script: ``python agent.py`` with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
``CORE_RL_ROW`` set, as the ``openai_agent`` workflow runs a script).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_task import calculator, score

_clients: dict[str, openai.AsyncOpenAI] = {}


def client_for(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """A client of ``base_url`` with ``api_key``. Creating an ``AsyncOpenAI`` costs 0.2 s or more
    (an SSL context and a connection pool); one is made per ``base_url`` and shared, each episode
    getting a copy with its own key (``with_options``, which keeps the connection pool). Many
    episodes connect at once, so connecting may wait longer than the client's default 5 s."""
    if base_url not in _clients:
        _clients[base_url] = openai.AsyncOpenAI(
            base_url=base_url, api_key="unset", max_retries=0, timeout=openai.Timeout(600, connect=60)
        )
    return _clients[base_url].with_options(api_key=api_key)


async def solve(base_url: str, api_key: str, row: dict) -> float:
    """One episode: question, model, calculator result, model's answer; returns the reward."""
    client = client_for(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    result = calculator(row["prompt"])
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "tool", "content": result},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return score(second.choices[0].message.content or "", result)


def main() -> None:
    """Script mode: one episode, its reward posted to the proxy."""
    base_url, api_key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    reward = asyncio.run(solve(base_url, api_key, json.loads(os.environ["CORE_RL_ROW"])))
    httpx.post(f"{base_url}/sessions/{api_key}/reward", json={"reward": reward}, timeout=30).raise_for_status()


if __name__ == "__main__":
    main()
