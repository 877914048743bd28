"""Agent functions the worker tests run in another process (``rollout.workflow.python``): each
makes one chat call through the proxy, then ends as its name says."""

from __future__ import annotations

import os

import openai

#: imports of this module in the process (one per worker: the function is imported once)
IMPORTS = int(os.environ.get("WORKER_AGENTS_IMPORTS", "0")) + 1
os.environ["WORKER_AGENTS_IMPORTS"] = str(IMPORTS)


async def _call(base_url: str, api_key: str, row: dict) -> str:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3
        )
    return reply.choices[0].message.content or ""


async def worker_pid(base_url: str, api_key: str, row: dict) -> float:
    """Reward: the process id of the worker (printing on the way: the protocol must not see it)."""
    print("a line on stdout from the agent")
    await _call(base_url, api_key, row)
    return float(os.getpid() * 10 + IMPORTS)


def sync_call(base_url: str, api_key: str, row: dict) -> float:
    """A plain function (the worker runs it in a thread) with the blocking client; reward 2."""
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}], max_tokens=2)
    return 2.0


async def raises(base_url: str, api_key: str, row: dict) -> float:
    await _call(base_url, api_key, row)
    raise ValueError("no answer in the reply")


async def dies(base_url: str, api_key: str, row: dict) -> float:
    await _call(base_url, api_key, row)
    os._exit(3)


def pid(**_: object) -> int:
    return os.getpid()


def exit_now(**_: object) -> None:
    os._exit(3)
