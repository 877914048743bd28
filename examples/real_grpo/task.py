"""The real example's task: two-digit addition, asked in words.

Prompt ``"What is 47 + 38?"``, answer ``"85"``; the ``math`` reward reads the response's final
answer (a boxed value, "the answer is ...", or its last number) and compares it with the answer. An
instruct model of 135M parameters answers about one in ten right at first, mostly because it
rambles past the token limit or answers with another number; GRPO teaches it to answer briefly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "What is 47 + 38?", "answer": "85"}`` with both terms in 10..99."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": question(a, b), "answer": str(a + b)})
    return out


def write_task(directory: Path, train: int = 2000, eval_count: int = 50) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` under ``directory`` (disjoint seeds, so the evaluation
    questions are mostly unseen); return both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, seed in (("train", train, 0), ("eval", eval_count, 1)):
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows(count, seed)), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]
