"""The padded batch layout built from samples."""

from __future__ import annotations

import pytest
import torch
from core_rl.protocol import Sample, TensorBatch, concat_padded, samples_to_batch
from hypothesis import given
from hypothesis import strategies as st


def test_samples_to_batch_layout():
    samples = [
        Sample(prompt_ids=[5, 6], response_ids=[7, 2], logprobs=[-0.5, -0.25], weight_version=3, finish_reason="stop"),
        Sample(
            prompt_ids=[8],
            response_ids=[9, 10, 11],
            logprobs=[-1.0, -2.0, -3.0],
            weight_version=3,
            finish_reason="length",
        ),
    ]
    b = samples_to_batch(samples, [0, 1], pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 2], [8, 9, 10, 11]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert b["old_logprobs"].tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, -2.0, -3.0]]
    short = samples_to_batch([*samples[:1], Sample([8], [9], [-1.0], 0, "stop")], [0, 0], pad_token_id=0)
    assert short["input_ids"][1].tolist() == [8, 9, 0, 0]
    assert short["attention_mask"][1].tolist() == [1, 1, 0, 0]


def test_sample_checks_logprob_count():
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        Sample([1], [2, 3], [-0.1], 0, "stop")


def test_tensor_batch_rows_and_concat():
    b = TensorBatch({"x": torch.arange(6).reshape(3, 2), "y": torch.tensor([1, 2, 3])})
    assert b.rows(torch.tensor([True, False, True]))["y"].tolist() == [1, 3]
    assert b.rows(slice(1, None, 2))["y"].tolist() == [2]
    assert TensorBatch.concat([b.rows([0]), b.rows([2])])["x"].tolist() == [[0, 1], [4, 5]]
    with pytest.raises(ValueError, match="batch size"):
        b["z"] = torch.zeros(2)
    with pytest.raises(ValueError, match="disagree"):
        TensorBatch({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_samples_carry_behaviour_logprobs_versions_and_truncation():
    samples = [
        Sample([5, 6], [7, 2], [-0.5, -0.25], weight_version=3, finish_reason="stop"),
        Sample([8], [9, 10, 11], [-1.0, -2.0, -3.0], weight_version=2, finish_reason="length"),
    ]
    b = samples_to_batch(samples, [0, 1], pad_token_id=0)
    assert torch.equal(b["behave_logprobs"], b["old_logprobs"])
    b["old_logprobs"][0, 2] = 9.0  # recomputing old log-probs never touches the behaviour ones
    assert b["behave_logprobs"][0, 2] == -0.5
    assert b["versions"].tolist() == [[-1, -1, 3, 3], [-1, 2, 2, 2]]
    assert b["truncated"].tolist() == [False, True]


def test_per_token_weight_versions_are_used_when_a_sample_has_them():
    # a sample whose generation spanned a weight update (the engine knows per-token versions)
    interrupted = Sample([1], [2, 3, 4], [-1.0] * 3, 4, "stop", token_weight_versions=[4, 4, 5])
    b = samples_to_batch([interrupted], [0], pad_token_id=0)
    assert b["versions"].tolist() == [[-1, 4, 4, 5]]
    assert interrupted.versions == [4, 4, 5] and interrupted.newest_version == 5


def row_by_row_batch(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The padded layout written one sample and one field at a time: the second formulation that
    :func:`samples_to_batch`'s flat buffers must agree with."""
    n, width = len(samples), max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    out = {
        "input_ids": torch.full((n, width), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((n, width), dtype=torch.long),
        "response_mask": torch.zeros((n, width)),
        "old_logprobs": torch.zeros((n, width)),
        "versions": torch.full((n, width), -1, dtype=torch.long),
        "turn_rewards": torch.zeros((n, width)),
    }
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        for t, token in enumerate([*s.prompt_ids, *s.response_ids]):
            out["input_ids"][i, t] = token
            out["attention_mask"][i, t] = 1
        for t in range(r):
            if s.token_mask is None or s.token_mask[t]:
                out["response_mask"][i, p + t] = 1.0
                out["old_logprobs"][i, p + t] = s.logprobs[t]
                out["versions"][i, p + t] = s.versions[t]
        for end, reward in zip(s.turn_ends or [], s.turn_rewards or []):
            out["turn_rewards"][i, p + end - 1] += reward
    return out


@st.composite
def samples(draw) -> list[Sample]:
    made = []
    for _ in range(draw(st.integers(1, 5))):
        p, r = draw(st.integers(1, 6)), draw(st.integers(0, 6))
        tokens = st.lists(st.integers(0, 50_000), min_size=p + r, max_size=p + r)
        ids = draw(tokens)
        logprobs = draw(st.lists(st.floats(-30, 0, width=32), min_size=r, max_size=r))
        per_token = draw(st.none() | st.lists(st.integers(0, 9), min_size=r, max_size=r))
        mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=r, max_size=r))
        ends = rewards = None
        if r and draw(st.booleans()):
            ends = sorted(draw(st.lists(st.integers(1, r), min_size=1, max_size=3)))
            rewards = draw(st.lists(st.floats(-2, 2, width=32), min_size=len(ends), max_size=len(ends)))
        made.append(
            Sample(
                ids[:p],
                ids[p:],
                logprobs,
                draw(st.integers(0, 9)),
                draw(st.sampled_from(["stop", "length"])),
                token_weight_versions=per_token,
                token_mask=mask,
                turn_rewards=rewards,
                turn_ends=ends,
            )
        )
    return made


@given(samples(), st.integers(0, 9))
def test_the_batch_agrees_with_the_layout_written_row_by_row(samples: list[Sample], pad: int) -> None:
    batch = samples_to_batch(samples, list(range(len(samples))), pad_token_id=pad)
    expected = row_by_row_batch(samples, pad)
    if not any(s.turn_ends for s in samples):
        assert "turn_rewards" not in batch
        del expected["turn_rewards"]
    for key, value in expected.items():
        assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key
    assert torch.equal(batch["behave_logprobs"], batch["old_logprobs"])
    assert batch["truncated"].tolist() == [s.finish_reason == "length" for s in samples]


def test_concat_padded_pads_each_key_with_its_value():
    short = samples_to_batch([Sample([1], [2], [-1.0], 0, "stop")], [0], pad_token_id=7)
    long = samples_to_batch([Sample([1], [2, 3, 4], [-1.0] * 3, 1, "length")], [1], pad_token_id=7)
    both = concat_padded([short, long], pad_token_id=7)
    assert both["input_ids"].tolist() == [[1, 2, 7, 7], [1, 2, 3, 4]]
    assert both["versions"].tolist() == [[-1, 0, -1, -1], [-1, 1, 1, 1]]
    assert both["response_mask"].tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]
    assert both["truncated"].tolist() == [False, True] and both["group_index"].tolist() == [0, 1]
