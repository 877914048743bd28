"""Micro-batch packing: limits, minimum count, every row once, order preserved."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from core_rl.data.balance import row_lengths
from core_rl.protocol import TensorBatch
from core_rl_train_kit.microbatch import micro_batch_cost, micro_batch_width, pack_micro_batches, take_micro_batch


def _flat(groups: list[list[int]]) -> list[int]:
    return [i for g in groups for i in g]


def test_row_lengths_uses_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    assert row_lengths(mask) == [3, 1, 0, 4, 3]
    assert row_lengths(torch.zeros(0, 5, dtype=torch.long)) == []


def test_width_and_cost() -> None:
    lengths = [3, 7, 2, 0]
    assert micro_batch_width(lengths, [0, 2]) == 3
    assert micro_batch_cost(lengths, [0, 1, 2]) == 21
    assert micro_batch_cost(lengths, [3]) == 1  # an all-padding row still takes one column
    assert micro_batch_cost(lengths, []) == 0


def test_greedy_packing_by_hand() -> None:
    lengths = [4, 4, 4, 8, 2, 2]
    # 4,4,4 -> 12; adding 8 would give 4*8=32 > 16; 8 alone; 8+2 -> 2*8=16 ok; +2 -> 24 > 16
    assert pack_micro_batches(lengths, 16) == [[0, 1, 2], [3, 4], [5]]
    assert pack_micro_batches(lengths, 1000) == [[0, 1, 2, 3, 4, 5]]


def test_overlong_row_gets_its_own_micro_batch() -> None:
    assert pack_micro_batches([3, 50, 3], 10) == [[0], [1], [2]]


def test_min_num_splits_the_costliest_evenly() -> None:
    assert pack_micro_batches([5] * 8, 1000, min_num=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the cut minimises the larger half: [9] alone costs 9, [1, 1, 1] costs 3
    assert pack_micro_batches([9, 1, 1, 1], 1000, min_num=2) == [[0], [1, 2, 3]]
    groups = pack_micro_batches([5] * 8, 1000, min_num=3)
    assert len(groups) == 3 and _flat(groups) == list(range(8))


def test_min_num_is_capped_by_the_number_of_rows() -> None:
    assert pack_micro_batches([2, 3], 100, min_num=5) == [[0], [1]]
    assert pack_micro_batches([], 100, min_num=3) == []


def test_rejects_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches([1], 0)


@pytest.mark.parametrize("seed", range(30))
def test_random_packings_respect_every_rule(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    lengths = [rng.randint(0, 30) for _ in range(n)]
    max_tokens = rng.randint(10, 200)
    min_num = rng.randint(1, 12)
    groups = pack_micro_batches(lengths, max_tokens, min_num)
    assert _flat(groups) == list(range(n))  # every row once, in order
    assert all(groups)
    assert len(groups) >= min(min_num, n)
    for g in groups:
        assert len(g) == 1 or micro_batch_cost(lengths, g) <= max_tokens
    # greedy alone is minimal: merging any two neighbours of the greedy result breaks the limit
    greedy = pack_micro_batches(lengths, max_tokens)
    for a, b in itertools.pairwise(greedy):
        assert micro_batch_cost(lengths, a + b) > max_tokens


def test_take_micro_batch_trims_only_token_tensors() -> None:
    batch = TensorBatch(
        {
            "input_ids": torch.arange(12).reshape(3, 4),
            "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]),
            "rewards": torch.tensor([0.1, 0.2, 0.3]),
            "extra": torch.ones(3, 2),
        }
    )
    mb = take_micro_batch(batch, [0, 2], 2)
    assert mb["input_ids"].tolist() == [[0, 1], [8, 9]]
    assert mb["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert mb["rewards"].tolist() == pytest.approx([0.1, 0.3])
    assert mb["extra"].shape == (2, 2)


@pytest.mark.parametrize("width", [2, 4])
def test_take_micro_batch_gives_new_contiguous_tensors(width: int) -> None:
    """Cut or not, no tensor is a view of the batch's (a compiled model guards on both)."""
    batch = TensorBatch({"input_ids": torch.arange(12).reshape(3, 4), "rewards": torch.tensor([0.1, 0.2, 0.3])})
    mb = take_micro_batch(batch, [2, 0], width)
    for key in mb.keys():
        assert mb[key].is_contiguous() and mb[key]._base is None, key
        assert mb[key].untyped_storage().data_ptr() != batch[key].untyped_storage().data_ptr(), key
    assert mb["input_ids"].tolist() == [[8, 9, 10, 11][:width], [0, 1, 2, 3][:width]]
