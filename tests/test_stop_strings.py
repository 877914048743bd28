"""Stop strings (:mod:`core_rl.rollout.stop_strings`, ``rollout.sampling.stop``): the cut by hand and as a
property over random tokenisations, the samples it leaves, and a GRPO run whose responses end at
the first stop string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_rl.protocol import Sample
from core_rl.rollout.stop_strings import apply_stop_strings, stop_cut, text_before_stop
from hypothesis import given, settings
from hypothesis import strategies as st

PIECES = ["he", "llo", " wor", "ld", "a", "b", "ab", "</s>"]


def decode(ids) -> str:
    return "".join(PIECES[i] for i in ids)


def test_the_cut_by_hand() -> None:
    chars = ["x", "a", "b", "y"]
    text = lambda ids: "".join(chars[i] for i in ids)  # noqa: E731
    ids = [0, 0, 1, 2, 3, 1, 2]  # "xxabyab"
    assert stop_cut(ids, text, ["ab"]) == 4  # "xxab": the token that completes the first "ab"
    assert stop_cut(ids, text, ["ab"], min_tokens=3) == 4  # the 4th token comes after the first 3
    assert stop_cut(ids, text, ["ab"], min_tokens=4) == 7  # "xxab" are the first 4: the next "ab"
    assert stop_cut(ids, text, ["ab"], min_tokens=7) is None  # no token after the 7th
    assert stop_cut(ids, text, ["yab", "zz"]) == 7
    assert stop_cut(ids, text, ["zz"]) is None and stop_cut([], text, ["a"]) is None and stop_cut(ids, text, []) is None
    # a token spanning the stop string's end stays whole: " wor" completes "lo w"
    assert stop_cut([0, 1, 2, 3], decode, ["lo w"]) == 3


def test_text_before_the_first_stop_string() -> None:
    assert text_before_stop("hello world", ["wor", "lo"]) == ("hel", "lo")
    assert text_before_stop("hello", ["x"]) == ("hello", None)
    assert text_before_stop("hello hello", ["lo"], after=4) == ("hel", "lo")  # the first "lo" ends at 5 > 4
    assert text_before_stop("hello hello", ["lo"], after=5) == ("hello hel", "lo")  # it does not end after 5


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PIECES) - 1), max_size=12),
    stops=st.lists(st.sampled_from(["ab", "b", "lo w", "ld</", "ba", "o"]), min_size=1, max_size=2),
    min_tokens=st.integers(0, 4),
)
def test_the_cut_is_the_fewest_tokens_that_complete_a_stop_after_min_tokens(ids, stops, min_tokens) -> None:
    """``k > min_tokens`` and the stop string ends in the text of a token after the first ``min_tokens``."""
    keep = stop_cut(ids, decode, stops, min_tokens=min_tokens)
    base = len(decode(ids[:min_tokens]))

    def ends_after_base(k: int) -> bool:  # a direct scan of every occurrence in the first k tokens' text
        text = decode(ids[:k])
        return any(text.startswith(s, i) and i + len(s) > base for s in stops for i in range(len(text)))

    if keep is None:
        assert len(ids) <= min_tokens or not ends_after_base(len(ids))
    else:
        low = min_tokens + 1
        assert low <= keep <= len(ids) and ends_after_base(keep)
        assert keep == low or not ends_after_base(keep - 1)


def test_samples_are_cut_with_their_log_probs_and_versions() -> None:
    sample = Sample(
        [9], [4, 5, 6, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5], 2, "length", token_weight_versions=[1, 1, 2, 2, 2]
    )
    untouched = Sample([9], [0, 1], [-0.1, -0.2], 2, "stop")
    cut, same = apply_stop_strings([sample, untouched], decode, ["b"], 0)
    assert (cut.response_ids, cut.logprobs, cut.token_weight_versions, cut.finish_reason) == (
        [4, 5],
        [-0.1, -0.2],
        [1, 1],
        "stop",
    )
    assert same is untouched


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def test_a_run_ends_every_response_at_its_first_stop_string(tmp_path: Path) -> None:
    from core_rl import cli
    from core_rl.testing.faults import build_task, merged

    base = build_task(tmp_path, prompts=("ab", "ca", "bcb"))
    config = merged(
        base,
        experiment={"name": "stops"},
        data={"batch_size": 3},
        rollout={**base["rollout"], "sampling": {"n": 4, "max_new_tokens": 12, "min_new_tokens": 1, "stop": ["b"]}},
        trainer={"total_steps": 2},
        saver={"every_n_steps": 0, "at_end": False},
        sample_log={"every_n_steps": 1, "num_samples": 12},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["train", str(path)]) == 0
    lines = (tmp_path / "runs" / "stops" / "samples.jsonl").read_text().splitlines()
    responses = [json.loads(line)["response"] for line in lines]
    assert len(responses) == 24
    for text in responses:  # the first "b" after the first token ends it; none before the end
        assert "b" not in text[1:-1], text
    assert any(text.endswith("b") and len(text) > 1 for text in responses)
    assert cli.main(["config", "validate", str(path), "rollout.sampling.stop=['']"]) == 2
