"""The padded batch layout built from samples."""

from __future__ import annotations

import pytest
import torch
from core_rl.protocol import Sample, TensorBatch, concat_padded, samples_to_batch


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


def test_concat_padded_pads_each_key_with_its_value():
    short = samples_to_batch([Sample([1], [2], [-1.0], 0, "stop")], [0], pad_token_id=7)
    long = samples_to_batch([Sample([1], [2, 3, 4], [-1.0] * 3, 1, "length")], [1], pad_token_id=7)
    both = concat_padded([short, long], pad_token_id=7)
    assert both["input_ids"].tolist() == [[1, 2, 7, 7], [1, 2, 3, 4]]
    assert both["versions"].tolist() == [[-1, 0, -1, -1], [-1, 1, 1, 1]]
    assert both["response_mask"].tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]
    assert both["truncated"].tolist() == [False, True] and both["group_index"].tolist() == [0, 1]
