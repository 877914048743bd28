"""Reward functions loaded from this file by path in ``tests/test_function_reward.py`` (the
``function`` reward): each is a plain function, as a user would write it."""

from __future__ import annotations

import asyncio
import threading
import zlib


def char_match(response: str, row: dict) -> float:
    """The ``char_match`` reward's default score, written out: the fraction of positions where the
    stripped response and answer agree, over the longer of the two."""
    r, a = response.strip(), str(row["answer"]).strip()
    width = max(len(r), len(a))
    return 1.0 if width == 0 else sum(x == y for x, y in zip(r, a)) / width


def scaled_length(response: str, *, scale: float, offset: float = 0.0) -> float:
    """``scale * len(response) + offset``: takes its constants from ``kwargs``."""
    return scale * len(response) + offset


def lengths_batched(response: list[str], finish_reason: list[str]) -> list[float]:
    """Batched: the length of each response, negative where it hit the length limit."""
    return [len(r) * (1.0 if f == "stop" else -1.0) for r, f in zip(response, finish_reason)]


async def async_length(response: str) -> float:
    await asyncio.sleep(0.01)
    return float(len(response))


def labelled(response: str) -> object:
    """A number for a non-empty response, a string (not a score) for an empty one."""
    return float(len(response)) if response else "empty"


THREADS: set[str] = set()


def thread_name(response: str) -> float:
    """Records the thread it runs in."""
    THREADS.add(threading.current_thread().name)
    return 1.0


def solves_ab(response: str, row: dict) -> float:
    """1 for every answer to the prompt whose answer is ``ab``, 0 for every other: one prompt always
    solved, whatever the policy says (``data.difficulty_filter``'s run test)."""
    return 1.0 if row["answer"] == "ab" else 0.0


def digit_fraction(response: str) -> float:
    """The fraction of the response's characters that are digits, plus a tie-breaker below 1e-3 from
    the text's CRC-32: a reward that differs between any two different samples of a real model's
    free text, so a GRPO group's advantages are not all zero. (Without it, a step whose samples held
    no digit had none: the four 8-token samples of a bfloat16 vLLM server on an AMX machine.)"""
    tie_breaker = zlib.crc32(response.encode()) / 2**32 * 1e-3
    return sum(c.isdigit() for c in response) / max(len(response), 1) + tie_breaker
