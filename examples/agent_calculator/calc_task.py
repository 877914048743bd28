"""The agent task: add two 2-digit numbers with a calculator tool.

A row is ``{"prompt": "37+45=", "answer": "82"}``. A trajectory that uses the tool::

    <s>37+45=  <c>37+45</c></s>  <r>82</r>  82</s>
    prompt     model turn 1      tool       model turn 2 (the answer)

The model's turns are trained; the tool's reply (``<r>...</r>``, from the ``calculator``
environment) is inserted and masked. A randomly initialised 2-layer model cannot add, so the answer
must come from the tool: the policy must call it and copy its result.

The warm start (supervised) teaches the format only: the call restates the question, and the
answer after the tool's reply is the reply's digits in a random order. Reinforcement learning must
teach the policy to copy the result in order (``char_match`` credit per position).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: the character vocabulary of the tiny model
ALPHABET = "0123456789+=<>/cr?"
NUMBERS = range(10, 100)


def rows() -> list[dict[str, str]]:
    """Every task row: all pairs of 2-digit numbers (8100)."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in NUMBERS for b in NUMBERS]


def call(row: dict[str, str]) -> str:
    """The model's first turn: the tool call restating the question."""
    return f"<c>{row['prompt'].rstrip('=')}</c>"


def write_dataset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows():
            f.write(json.dumps(row) + "\n")
    return path


def write_warm_start_data(path: Path, *, count: int, seed: int) -> Path:
    """``count`` SFT rows, half of each kind: a prompt answered by its call, and a prompt followed by
    its call and the tool's reply answered by the reply's digits shuffled (format, not content)."""
    rng = random.Random(seed)
    task = rows()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in range(count):
            row = rng.choice(task)
            if i % 2 == 0:
                item = {"prompt": row["prompt"], "response": call(row)}
            else:
                digits = list(row["answer"])
                rng.shuffle(digits)
                context = f"{row['prompt']}{call(row)}</s><r>{row['answer']}</r>"
                item = {"prompt": context, "response": "".join(digits)}
            f.write(json.dumps(item) + "\n")
    return path
