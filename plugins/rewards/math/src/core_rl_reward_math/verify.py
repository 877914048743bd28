"""What runs inside a verifier worker process: math-verify's parse and verify of one pair."""

from __future__ import annotations


def _timeouts_are_the_pools() -> None:
    """Mark math-verify's notice that its timeouts are off ("Timeout is disabled as ... you must
    provide the logic for timeout interuption yourself", once per process from ``parse`` and once
    from ``verify``) as already shown: the caller's pool bounds each item's time (its worker is
    killed past ``timeout_s``), so the notice asks for what is already there. Its own signal-based
    timeouts stay off: they round to whole seconds and would score a timed-out item 0 without
    counting it as a timeout."""
    from math_verify import grader, parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


def warm_up() -> None:
    """Worker initializer: import math-verify (and sympy, antlr) before any item is timed."""
    from math_verify import parse, verify

    _timeouts_are_the_pools()
    verify(parse("$1$"), parse("$1$"))


def verify_pair(gold: str, answer: str, float_rounding: int, strict: bool) -> bool:
    """Whether ``answer`` is mathematically equivalent to ``gold`` (both LaTeX for math-verify's
    ``parse``). math-verify's own signal-based timeouts are off: the caller's pool kills a worker
    that runs past the item's time limit."""
    from math_verify import parse, verify

    _timeouts_are_the_pools()
    gold_parsed = parse(gold, parsing_timeout=None)
    answer_parsed = parse(answer, parsing_timeout=None)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, float_rounding=float_rounding, strict=strict, timeout_seconds=None))
