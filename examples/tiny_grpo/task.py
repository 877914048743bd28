"""The example task: reverse a short string.

Prompt ``"<s>" + s + "="`` where ``s`` is 3-4 letters from ``abcdef``; the answer is ``s`` reversed,
then ``</s>``. The ``char_match`` reward gives partial credit per position, so a policy that only
knows the format already scores about a third and the reward climbs smoothly as it learns.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

LETTERS = "abcdef"
LENGTHS = (3, 4)


def all_strings() -> list[str]:
    """Every string of the task: 6^3 + 6^4 = 1512 of them."""
    return ["".join(p) for n in LENGTHS for p in itertools.product(LETTERS, repeat=n)]


def prompt_text(s: str) -> str:
    return f"{s}="


def answer(s: str) -> str:
    return s[::-1]


def write_dataset(path: Path, strings: list[str] | None = None) -> Path:
    """One JSON row per string (default: every string of the task): ``{"prompt": "abc=", "answer": "cba"}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for s in all_strings() if strings is None else strings:
            f.write(json.dumps({"prompt": prompt_text(s), "answer": answer(s)}) + "\n")
    return path


def eval_strings(count: int = 64, seed: int = 0) -> list[str]:
    """The strings of the evaluation set: ``count`` of the task's, drawn once with ``seed``."""
    return random.Random(seed).sample(all_strings(), count)


def format_only_answer(s: str, rng: random.Random) -> str:
    """A warm-start target with the right format but not the right content: the prompt's letters
    in a random order (so the warm-started policy answers with plausible letters of the right
    length and must learn the reversal from reward alone)."""
    letters = list(s)
    rng.shuffle(letters)
    return "".join(letters)
