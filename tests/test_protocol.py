"""The padded batch layout built from samples."""

from __future__ import annotations

import pytest
import torch
from core_rl.protocol import Sample, TensorBatch, samples_to_batch


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
