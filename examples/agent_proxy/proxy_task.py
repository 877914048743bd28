"""The example task: add two digits with a calculator tool, and answer with its result.

Prompt ``"a+b"`` for digits ``a``, ``b``; the answer is ``str(a + b)``. The agent (``agent.py``)
asks the model, runs the calculator on the question itself and sends the result back as a ``tool``
message; the model's second reply must copy the result. The tiny model's vocabulary is the digits
plus the chat template's few characters, so a random policy already answers digits sometimes and
the reward (the fraction of the result's characters the answer has in place) climbs as it learns
to copy the tool's result.

Shared-task note: ``examples/agent_calculator/`` (the environment-based calculator example) has a
generator of its own; once both are merged, this file's :func:`write_dataset` can be replaced by
that one's, keeping the ``prompt``/``answer`` columns.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

#: the tiny model's characters: digits, "+", and what the chat template writes (roles u/a/t, ":", ">")
ALPHABET = "0123456789+:>uat"

#: the chat template of the tiny tokenizer (``rollout.workflow.chat_template``): ``<s>``, then ``u:…>``
#: per user turn, ``t:…>`` per tool turn, ``a:…</s>`` per assistant turn; ``a:`` as the generation prompt
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"


def calculator(expression: str) -> str:
    """The tool: the sum of ``"a+b"`` (digits only; anything else is ``"?"``)."""
    parts = expression.split("+")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return "?"
    return str(int(parts[0]) + int(parts[1]))


def score(answer: str, result: str) -> float:
    """Fraction of ``result``'s characters ``answer`` has at the same position, less 0.5 per
    character ``answer`` has beyond it: ``(|{i : answer[i] == result[i]}| - 0.5 * max(0,
    len(answer) - len(result))) / len(result)``, at least 0."""
    hits = sum(a == b for a, b in zip(answer, result))
    extra = max(0, len(answer) - len(result))
    return max(0.0, (hits - 0.5 * extra) / len(result))


def write_dataset(path: Path) -> Path:
    """One JSON row per pair of digits: ``{"prompt": "3+4", "answer": "7"}`` (100 rows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for a, b in itertools.product(range(10), repeat=2):
            f.write(json.dumps({"prompt": f"{a}+{b}", "answer": str(a + b)}) + "\n")
    return path
