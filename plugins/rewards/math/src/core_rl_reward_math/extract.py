"""Final-answer extraction from a response (pure string functions, no sympy).

Strategies, each returning the *last* answer of its kind or ``None``:

- ``boxed``: the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces balanced;
  ``\\boxed 5`` takes the next token);
- ``answer_is``: what follows the last "answer is", "answer:" (also "final answer is") up to the
  end of that line, without a trailing full stop;
- ``last_number``: the last integer, decimal or fraction (``-12``, ``3.5``, ``1,000``, ``3/4``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_BOX = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS = re.compile(r"(?i)\banswer\s*(?:is\b\s*:?|:)")
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|(?<![\w.])-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")


def _balanced(text: str, start: int) -> str | None:
    """The content of the brace group opening at ``text[start] == '{'``; ``None`` if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed x``)."""
    for match in reversed(list(_BOX.finditer(text))):
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            content = _balanced(text, rest)
            if content is not None:
                return content.strip()
        elif rest > match.end():
            token = re.match(r"[^\s$]+", text[rest:])
            if token:
                return token.group(0)
    return None


def answer_is(text: str) -> str | None:
    """What follows the last "answer is" / "answer:" up to the end of the line."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].split("\n", 1)[0].strip()
    rest = rest.rstrip(".").strip()
    return rest or None


def last_number(text: str) -> str | None:
    """The last number in ``text``, thousands separators removed."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return re.sub(r"\s+", "", matches[-1]).replace(",", "")


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": last_boxed,
    "answer_is": answer_is,
    "last_number": last_number,
}


def find_answer(text: str, strategies: Sequence[str]) -> tuple[str, str] | None:
    """``(strategy, answer)`` from the first strategy (in order) that finds one, else ``None``."""
    for name in strategies:
        found = EXTRACTORS[name](text)
        if found:
            return name, found
    return None


def extract_answer(text: str, strategies: Sequence[str]) -> str | None:
    """The answer found by the first strategy (in order) that finds one, else ``None``."""
    found = find_answer(text, strategies)
    return None if found is None else found[1]


def as_latex_answer(answer: str) -> str:
    """Wrap an answer for math-verify's parser: ``\\boxed{answer}``, unless it already carries its
    own math delimiters (``$...$``, ``\\(...\\)``, ``\\[...\\]``) or a ``\\boxed``."""
    stripped = answer.strip()
    if stripped.startswith(("$", "\\(", "\\[")) or "\\boxed" in stripped:
        return stripped
    return "\\boxed{" + stripped + "}"


def parser_input(strategy: str, answer: str) -> str:
    """What math-verify's ``parse`` gets for an extracted answer: a boxed expression for ``boxed``
    and ``last_number``; for ``answer_is`` the words as they are, which math-verify searches for
    their math (so "18 dollars" reads as 18)."""
    return answer if strategy == "answer_is" else as_latex_answer(answer)
