"""Balanced packing (first-fit-decreasing, Karmarkar-Karp), rank assignment, and the packed
(padding-free) layout against the padded one on a real tiny model."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from core_rl.data.balance import assign_rows_to_ranks, karmarkar_karp, rank_rows
from core_rl.testing import make_rl_batch
from core_rl_train_kit.microbatch import micro_batch_cost
from core_rl_train_kit.packed import forward_logprobs, pack_rows, resolve_layout, unpack
from core_rl_train_kit.packing import evened_first_fit_decreasing, first_fit_decreasing, packed_cost, plan_micro_batches
from hypothesis import given, settings
from hypothesis import strategies as st


def _flat(groups: list[list[int]]) -> list[int]:
    return sorted(i for g in groups for i in g)


def _sums(weights: list[int], parts: list[list[int]]) -> list[int]:
    return [sum(weights[i] for i in p) for p in parts]


# -- first-fit-decreasing --------------------------------------------------------------------------


def test_ffd_by_hand_packed_cost() -> None:
    # decreasing: 7(1) 5(3) 4(0) 3(4) 2(2); capacity 10: [7,3] [5,4] then 2 fits nowhere but... [5,4]=9 +2 > 10
    assert first_fit_decreasing([4, 7, 2, 5, 3], 10, packed_cost) == [[1, 4], [0, 3], [2]]


def test_ffd_by_hand_padded_cost() -> None:
    # padded cost rows*width: 8 alone (8); 4+4 -> 2*4 = 8; third 4 -> 12 > 8; 2s join the 4s' bins? 3*4 > 8
    assert first_fit_decreasing([4, 8, 4, 4, 2, 2], 8) == [[1], [0, 2], [3, 4], [5]]


def test_ffd_keeps_overlong_rows_alone() -> None:
    assert first_fit_decreasing([30, 3, 3], 10, packed_cost) == [[0], [1, 2]]


# -- Karmarkar-Karp --------------------------------------------------------------------------------


def test_kk_two_way_by_hand() -> None:
    # differencing 8,7 -> 1; 6,5 -> 1; then {4, 1, 1}: 4-1 -> 3; 3-1 -> 2: sums 16 and 14
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(_sums([8, 7, 6, 5, 4], parts)) == [14, 16]
    assert _flat(parts) == [0, 1, 2, 3, 4]


def test_kk_finds_perfect_three_way_split() -> None:
    weights = [5, 5, 4, 3, 3, 2, 2, 1]  # total 25 ... plus one: 27 / 3 = 9
    weights.append(2)
    parts = karmarkar_karp(weights, 3)
    assert _sums(weights, parts) == [9, 9, 9]


def test_kk_with_fewer_items_than_parts() -> None:
    assert karmarkar_karp([3], 3) == [[0], [], []]
    assert karmarkar_karp([], 2) == [[], []]


@given(st.lists(st.integers(1, 60), min_size=1, max_size=14), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_kk_is_a_partition_within_the_greedy_bound(weights: list[int], k: int) -> None:
    parts = karmarkar_karp(weights, k)
    assert len(parts) == k and _flat(parts) == list(range(len(weights)))
    sums = _sums(weights, parts)
    # any list-scheduling bound: the heaviest part exceeds the mean by less than the largest item
    assert max(sums) <= sum(weights) / k + max(weights)


def test_kk_is_optimal_on_small_instances_more_often_than_round_robin() -> None:
    rng = random.Random(0)
    kk_gap = rr_gap = 0
    for _ in range(40):
        weights = [rng.randint(1, 40) for _ in range(8)]
        best = min(
            max(sum(w for w, side in zip(weights, mask) if side), sum(w for w, side in zip(weights, mask) if not side))
            for mask in itertools.product([0, 1], repeat=len(weights))
        )
        kk_gap += max(_sums(weights, karmarkar_karp(weights, 2))) - best
        rr_gap += max(_sums(weights, assign_rows_to_ranks(weights, 2, "strided"))) - best
    assert kk_gap < rr_gap / 4, (kk_gap, rr_gap)


# -- micro-batch plans -----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["greedy", "ffd", "kk"])
@pytest.mark.parametrize("packed", [False, True])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=30),
    max_tokens=st.integers(8, 200),
    min_num=st.integers(1, 10),
)
@settings(max_examples=40, deadline=None)
def test_plans_respect_budget_and_minimum(
    algorithm: str, packed: bool, lengths: list[int], max_tokens: int, min_num: int
) -> None:
    groups = plan_micro_batches(lengths, max_tokens, min_num, algorithm=algorithm, packed=packed)
    assert _flat(groups) == list(range(len(lengths)))
    assert all(groups) and len(groups) >= min(min_num, len(lengths))
    cost = packed_cost if (packed and algorithm != "greedy") else micro_batch_cost
    for g in groups:
        assert len(g) == 1 or cost(lengths, g) <= max_tokens
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


def test_ffd_needs_fewer_micro_batches_than_greedy_on_mixed_lengths() -> None:
    lengths = [30, 2, 30, 2, 30, 2, 30, 2]
    assert len(plan_micro_batches(lengths, 64, algorithm="greedy")) == 4  # 2 rows of width 30 each
    assert len(plan_micro_batches(lengths, 64, algorithm="ffd")) == 3  # the four short rows together


def test_kk_balances_micro_batch_loads() -> None:
    lengths = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    groups = plan_micro_batches(lengths, 20, algorithm="kk", packed=True)
    loads = sorted(packed_cost(lengths, g) for g in groups)
    assert len(groups) == 3 and loads == [15, 15, 15]


# -- ranks ------------------------------------------------------------------------------------------


def test_rank_assignment_balances_tokens() -> None:
    lengths = [100, 5, 90, 5, 80, 5, 70, 5]
    strided = assign_rows_to_ranks(lengths, 2, "strided")
    assert strided == [[0, 2, 4, 6], [1, 3, 5, 7]]
    balanced = assign_rows_to_ranks(lengths, 2)
    assert _flat(balanced) == list(range(8))
    assert _sums(lengths, balanced) == [180, 180]
    assert assign_rows_to_ranks(lengths, 1) == [list(range(8))]
    with pytest.raises(ValueError, match="rank assignment"):
        assign_rows_to_ranks(lengths, 2, "random")


def test_rank_rows_reads_lengths_from_the_mask() -> None:
    batch = make_rl_batch(batch_size=6, seed=1)
    lengths = batch["attention_mask"].sum(1).tolist()
    parts = [rank_rows(batch, r, 2) for r in range(2)]
    assert parts == assign_rows_to_ranks(lengths, 2)
    assert rank_rows(batch, 1, 3, "strided") == [1, 4]


# -- packed layout ----------------------------------------------------------------------------------


def test_pack_rows_and_unpack_by_hand() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert packed.continues.tolist() == [[0, 1, 1, 0, 1, 0]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 3
    values = torch.arange(6, dtype=torch.float32)[None] + 1
    assert unpack(values, packed).tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(ids, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))


def test_layout_resolution() -> None:
    assert resolve_layout("auto", "sdpa") == "shared"  # runs padded where no rows share a prompt
    assert resolve_layout("auto", "sdpa", "it uses a sliding window (8)") == "padded"
    assert resolve_layout("auto", None) == "padded"
    assert resolve_layout("auto", "flash_attention_2") == "packed"
    assert resolve_layout("packed", "sdpa") == "packed"
    with pytest.raises(ValueError, match="layout"):
        resolve_layout("ragged", None)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory):
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path: Path = build_tiny_model(tmp_path_factory.mktemp("packing") / "model", seed=3)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_packed_forward_equals_padded_and_so_does_the_loss_gradient(tiny_lm, temperature: float) -> None:
    batch = make_rl_batch(batch_size=5, seed=2)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    results = {}
    for layout in ("padded", "packed"):
        tiny_lm.zero_grad()
        lp, ent = forward_logprobs(tiny_lm, ids, mask, temperature=temperature, with_entropy=True, layout=layout)
        assert ent is not None and lp.shape == ids.shape
        loss = ((-lp - 0.1 * ent) * batch["loss_weight"]).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in tiny_lm.named_parameters()}
        results[layout] = (lp.detach(), ent.detach(), loss.item(), grads)
    (lp_a, ent_a, loss_a, g_a), (lp_b, ent_b, loss_b, g_b) = results["padded"], results["packed"]
    torch.testing.assert_close(lp_b, lp_a, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=2e-5, rtol=0)
    assert (lp_b[:, 0] == 0).all() and (lp_b[mask == 0] == 0).all()
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-5, rtol=1e-4, msg=name)


def test_ffd_evens_out_a_last_micro_batch_that_would_be_nearly_empty() -> None:
    """64 rows of 276 tokens under a 16384 budget (an H100 GRPO batch): first-fit-decreasing alone
    gives 59 rows and 5; evened, two micro-batches of 32 rows. The peak of the activations kept
    for backward follows the costliest micro-batch."""
    lengths = [276] * 64
    assert [len(g) for g in first_fit_decreasing(lengths, 16384)] == [59, 5]
    for packed in (False, True):
        groups = plan_micro_batches(lengths, 16384, packed=packed)
        assert [len(g) for g in groups] == [32, 32]


@given(
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=40),
    capacity=st.integers(30, 300),
    packed=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_evened_ffd_never_needs_more_micro_batches_nor_a_costlier_one(
    lengths: list[int], capacity: int, packed: bool
) -> None:
    cost = packed_cost if packed else micro_batch_cost
    plain = first_fit_decreasing(lengths, capacity, cost)
    evened = evened_first_fit_decreasing(lengths, capacity, cost)
    assert _flat(evened) == list(range(len(lengths)))
    assert len(evened) <= len(plain)
    assert max(cost(lengths, g) for g in evened) <= max(cost(lengths, g) for g in plain)
    assert all(len(g) == 1 or cost(lengths, g) <= capacity for g in evened)
