"""Answer extraction strategies, the parser input and the reward's parts, timeouts and errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError, DataError
from core_rl.testing import make_reward_input
from core_rl_reward_math.config import MathConfig
from core_rl_reward_math.extract import answer_is, extract_answer, last_boxed, last_number, parser_input
from core_rl_reward_math.reward import MathReward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{5}", "5"),
        ("a \\boxed{1} then \\boxed{\\frac{1}{2}} end", "\\frac{1}{2}"),  # the last one
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 9 is it", "9"),
        ("\\boxed{unclosed", None),
        ("no box", None),
        ("\\boxedx{3}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("answer: $x=2$\nmore text", "$x=2$"),
        ("The final answer is: 3/4", "3/4"),
        ("First answer is 1. Then the ANSWER IS 2.", "2"),
        ("The answer is", None),
        ("no such phrase", None),
    ],
)
def test_answer_is(text, expected):
    assert answer_is(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1 and 2 and 3", "3"),
        ("total 1,000 apples", "1000"),
        ("x = -12", "-12"),
        ("ratio 3 / 4", "3/4"),
        ("pi is 3.14.", "3.14"),
        ("var2 is not a number", None),
        ("none", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_strategies_run_in_the_configured_order():
    text = "The answer is 3, \\boxed{4}, and 5"
    assert extract_answer(text, ["boxed", "answer_is", "last_number"]) == "4"
    assert extract_answer(text, ["answer_is", "boxed"]) == "3, \\boxed{4}, and 5"
    assert extract_answer(text, ["last_number"]) == "5"
    assert extract_answer("nothing here", ["boxed", "answer_is"]) is None


def test_parser_input():
    assert parser_input("boxed", "\\frac12") == "\\boxed{\\frac12}"
    assert parser_input("last_number", "3") == "\\boxed{3}"
    assert parser_input("boxed", "$x$") == "$x$"
    assert parser_input("answer_is", "18 dollars") == "18 dollars"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extract": []}, "reward.extract: must list at least one of boxed, answer_is, last_number"),
        ({"extract": ["boxed", "first_number"]}, "reward.extract: must only name"),
        ({"timeout_s": 0}, "reward.timeout_s: must be > 0"),
        ({"num_workers": 0}, "reward.num_workers"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ConfigError, match=message):
        structure(options, MathConfig, path="reward")


def _children() -> set[int]:
    """PIDs of this process's spawned multiprocessing workers."""
    me = str(os.getpid())
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == me and b"spawn_main" in cmdline:
            pids.add(int(proc.name))
    return pids


def test_a_slow_item_times_out_alone_and_its_worker_is_killed():
    # sympy needs ~25 s on this 2-core machine to prove sin^8000 = (1 - cos^2)^4000 (about 1 s for
    # sin^400): far past the 1 s limit on any machine
    reward = MathReward(MathConfig(timeout_s=1.0, num_workers=1))
    try:
        warm = reward.score_with_parts([make_reward_input("\\boxed{1}", {"answer": "1"})])
        assert warm.scores == [1.0]
        workers = _children()
        items = [
            make_reward_input("\\boxed{(1-\\cos(x)^2)^{4000}}", {"answer": "\\sin(x)^{8000}"}),
            make_reward_input("\\boxed{0.25}", {"answer": "\\frac{1}{4}"}),
            make_reward_input("the answer is 3", {"answer": "4"}),
            make_reward_input("nothing", {"answer": "4"}),
        ]
        result = reward.score_with_parts(items)
        assert result.scores == [0.0, 1.0, 0.0, 0.0]
        assert result.parts == {"answer_found": [1.0, 1.0, 1.0, 0.0], "timeout": [1.0, 0.0, 0.0, 0.0]}
        killed = workers - _children()
        assert killed, "the worker that ran past its limit must be gone"
    finally:
        reward.close()
    assert not (_children() & workers)


def test_missing_answer_is_a_data_error():
    reward = MathReward()
    with pytest.raises(DataError, match=r"no 'answer' column \(its keys: 'question'\).*reward.answer_key"):
        reward.score([make_reward_input("\\boxed{1}", {"question": "1+0"})])
    with pytest.raises(DataError, match="its keys: none"):
        reward.score([make_reward_input("1", {})])
    with pytest.raises(DataError, match="'answer' is null"):
        reward.score([make_reward_input("1", {"answer": None})])
    reward.close()
