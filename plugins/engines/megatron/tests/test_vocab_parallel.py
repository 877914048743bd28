"""The vocabulary-parallel log-prob and entropy formulas against the core's full-vocabulary
``token_logprobs`` and autograd's whole-tensor formulation (``core_rl.testing.reference``), values
and gradients, with padded vocabulary columns and chunks down to one row: on one rank here, over 3
gloo ranks (``vocab_parallel_worker.py``), and inside the engine with the vocabulary split over 2
ranks (``test_distributed.py``). What backward keeps: the logits and per-token values only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.testing import reference
from core_rl.testing.launch import run_torchrun
from core_rl_megatron.vocab_parallel import vocab_parallel_stats
from core_rl_train_kit import logprobs
from core_rl_train_kit.logprobs import align_to_tokens, token_logprobs
from hypothesis import given, settings
from hypothesis import strategies as st

WORKER = Path(__file__).parent / "vocab_parallel_worker.py"


@pytest.mark.parametrize(("seed", "temperature", "padded"), [(0, 1.0, 0), (1, 0.6, 5), (2, 1.7, 3)])
def test_matches_full_vocabulary_softmax(seed: int, temperature: float, padded: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = 29
    logits = torch.randn(3, 8, vocab + padded, generator=g, dtype=torch.float64).float() * 4
    ids = torch.randint(0, vocab, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[2, 6:] = 0
    w1, w2 = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)

    ref_in = logits[..., :vocab].clone().requires_grad_(True)
    ref_lp, ref_ent = token_logprobs(ref_in, ids, mask, temperature, with_entropy=True)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()

    got_in = logits.clone().requires_grad_(True)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # position i scores token i + 1
    lp, ent = vocab_parallel_stats(
        got_in, targets, vocab_start=0, vocab_size=vocab, temperature=temperature, with_entropy=True
    )
    lp, ent = align_to_tokens(lp[:, :-1], mask), align_to_tokens(ent[:, :-1], mask)
    ((lp * w1).sum() + (ent * w2).sum()).backward()

    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=5e-6, rtol=0)
    torch.testing.assert_close(got_in.grad[..., :vocab], ref_in.grad, atol=1e-5, rtol=1e-5)
    assert not got_in.grad[..., vocab:].any(), "padded vocabulary columns must get no gradient"
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_hand_computed_two_token_vocabulary() -> None:
    """Logits (0, ln 3): p = (1/4, 3/4); log p(1) = ln 0.75; H = -(0.25 ln 0.25 + 0.75 ln 0.75)."""
    logits = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])
    lp, ent = vocab_parallel_stats(logits, torch.tensor([[1]]), vocab_start=0, vocab_size=2, with_entropy=True)
    assert lp.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-6)
    expected = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75))).item()
    assert ent.item() == pytest.approx(expected, abs=1e-6)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_stats(
            torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), vocab_start=0, vocab_size=2, temperature=0
        )


def test_entropy_without_gradient() -> None:
    """``entropy_grad=False``: the same values, an entropy without gradient, and the log-prob's
    gradient unchanged."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    out = {}
    for grad in (True, False):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_stats(x, targets, vocab_start=0, vocab_size=11, with_entropy=True, entropy_grad=grad)
        assert ent.requires_grad is grad
        lp.sum().backward()
        out[grad] = (lp.detach(), ent.detach(), x.grad)
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 3),
    width=st.integers(2, 9),
    vocab=st.integers(2, 30),
    padded=st.integers(0, 6),
    chunk=st.integers(1, 80),
    temperature=st.one_of(st.just(1.0), st.floats(0.3, 2.0)),
    entropy=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_rank_any_shape_and_chunking_against_the_whole_tensor_formulation(
    rows, width, vocab, padded, chunk, temperature, entropy, bfloat16, seed
) -> None:
    """Any shape, padding and chunk size (down to one row a chunk): the values and the gradient of
    any weighting of both outputs agree with autograd's whole-tensor formulation on the real
    columns, and the padded columns get no gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab + padded, generator=g) * 4
    logits[..., vocab:] = 50.0  # padding: would dominate the softmax if it were counted
    if bfloat16:
        logits = logits.bfloat16()
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    weights = (torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g))

    ref_in = logits[..., :vocab].clone().requires_grad_(True)
    ref_lp, ref_ent = reference.token_logprobs(ref_in, ids, mask, temperature, with_entropy=entropy)
    ((ref_lp * weights[0]).sum() + ((ref_ent * weights[1]).sum() if entropy else 0.0)).backward()

    got_in = logits.clone().requires_grad_(True)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
        lp, ent = vocab_parallel_stats(
            got_in, targets, vocab_start=0, vocab_size=vocab, temperature=temperature, with_entropy=entropy
        )
        lp = align_to_tokens(lp[:, :-1], mask)
        loss = (lp * weights[0]).sum()
        if entropy:
            ent = align_to_tokens(ent[:, :-1], mask)
            loss = loss + (ent * weights[1]).sum()
        loss.backward()

    torch.testing.assert_close(lp, ref_lp, atol=5e-6, rtol=0)
    assert (ent is None) is (not entropy)
    if entropy:
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=0)
    assert got_in.grad.dtype == logits.dtype
    tolerance = 1e-2 if bfloat16 else 1e-5
    torch.testing.assert_close(got_in.grad[..., :vocab].float(), ref_in.grad.float(), atol=tolerance, rtol=tolerance)
    assert not got_in.grad[..., vocab:].any(), "padded vocabulary columns must get no gradient"


def test_three_ranks_against_the_whole_tensor_formulation(tmp_path: Path) -> None:
    """The vocabulary split over 3 gloo ranks (the last slice partly padding, or padding only):
    every rank holds the same values, and the gathered gradients equal the whole-vocabulary ones,
    for float32 and bfloat16, one-row chunks, log-probs alone and the entropy as a metric."""
    out = tmp_path / "result.json"
    run_torchrun(WORKER, 3, "--out", str(out), timeout=180)
    results = json.loads(out.read_text())
    assert len(results) == 6
    for name, r in results.items():
        grad_tolerance = 1e-2 if name == "bfloat16" else 1e-5
        assert r["logprob"] < 5e-6 and r["entropy"] < 2e-5 and r["grad"] < grad_tolerance, (name, r)
        assert r["grad_padding"] == 0.0 and r["same_on_every_rank"], (name, r)


def test_only_the_logits_and_per_token_values_are_kept_for_backward() -> None:
    """Backward keeps the logits (the model's output, in its own dtype) and a few values per
    token; no vocabulary-sized float32 tensor."""
    g = torch.Generator().manual_seed(0)
    b, s, width = 2, 6, 64
    logits = (torch.randn(b, s, width, generator=g) * 2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 60, (b, s), generator=g)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = vocab_parallel_stats(logits, targets, vocab_start=0, vocab_size=60, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert saved[0] <= logits.numel() * logits.element_size() + 24 * b * s, saved[0]
    assert torch.isfinite(logits.grad).all()
