"""Log-probs and entropies of causal-LM logits: alignment against a direct computation, values and
gradients of the chunked computation against autograd's whole-tensor formulation
(:func:`core_rl.testing.reference.token_logprobs`), a hand-computed gradient, and what is kept for
backward."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.testing import reference
from core_rl_train_kit import logprobs
from core_rl_train_kit.logprobs import token_logprobs
from hypothesis import given, settings
from hypothesis import strategies as st


def test_alignment_temperature_and_padding() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    ids = torch.tensor([[1, 2, 3, 4], [0, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logits[1, 2:] = float("nan")  # garbage under padding must not leak
    lp, ent = token_logprobs(logits, ids, mask, temperature=0.5, with_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (2, 4)
    for b in range(2):
        for t in range(4):
            if t == 0 or mask[b, t] == 0:
                assert lp[b, t] == 0 and ent[b, t] == 0
                continue
            p = torch.softmax(logits[b, t - 1] / 0.5, dim=-1)
            assert lp[b, t].item() == pytest.approx(math.log(p[ids[b, t]].item()), abs=1e-5)
            assert ent[b, t].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_without_entropy_and_bad_temperature() -> None:
    lp, ent = token_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]), torch.ones(1, 3))
    assert ent is None
    assert lp[0, 1:].tolist() == pytest.approx([math.log(0.25)] * 2)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]), torch.ones(1, 3), 0.0)


def test_align_to_tokens_places_predictions_on_the_tokens_they_predict() -> None:
    from core_rl_train_kit.logprobs import align_to_tokens

    per_prediction = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = align_to_tokens(per_prediction, mask)
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 4.0, 0.0, 0.0]]))


def _saved_bytes(fn) -> tuple[int, object]:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs, and its result."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved[0], out


def _both(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float, weights: tuple, *, entropy: bool
) -> dict[str, tuple]:
    """Log-probs, entropies and the gradient of ``sum(w1 lp) + sum(w2 H)`` from the chunked
    computation and from the reference formulation."""
    out = {}
    for name, fn in (("chunked", token_logprobs), ("reference", reference.token_logprobs)):
        x = logits.clone().requires_grad_(True)
        lp, ent = fn(x, ids, mask, temperature, with_entropy=entropy)
        loss = (lp * weights[0]).sum() + ((ent * weights[1]).sum() if entropy else 0.0)
        loss.backward()
        out[name] = (lp.detach(), None if ent is None else ent.detach(), x.grad)
    return out


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(2, 12),
    vocab=st.integers(2, 40),
    chunk=st.integers(1, 90),
    temperature=st.one_of(st.just(1.0), st.floats(0.3, 2.0)),
    scale=st.floats(0.1, 8.0),
    entropy=st.booleans(),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_the_whole_tensor_formulation(
    rows, width, vocab, chunk, temperature, scale, entropy, bfloat16, seed
) -> None:
    """Any shape, chunking (down to one row per chunk, a last chunk cut short), temperature,
    padding and dtype: the same log-probs and entropies bit for bit (the same operations on every
    row), and the gradient of any weighting of both to float rounding."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, vocab, generator=g) * scale
    if bfloat16:
        logits = logits.bfloat16()
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    weights = (torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
        out = _both(logits, ids, mask, temperature, weights, entropy=entropy)
    (lp, ent, grad), (ref_lp, ref_ent, ref_grad) = out["chunked"], out["reference"]
    assert torch.equal(lp, ref_lp)
    assert (ent is None) is (not entropy) and (ent is None or torch.equal(ent, ref_ent))
    assert grad.dtype == logits.dtype
    tolerance = 1e-2 if bfloat16 else 2e-6
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=tolerance, rtol=tolerance)


def test_gradient_by_hand() -> None:
    """Uniform logits over 4 tokens at temperature 0.5: ``log p = log 1/4``, ``H = log 4``;
    ``d lp_y / d logits_v = (1[v = y] - 1/4) / 0.5``; the entropy is at its maximum, so its
    gradient is 0: ``-p_v (log p_v + H) = -1/4 (log 1/4 + log 4) = 0``."""
    x = torch.zeros(1, 2, 4, requires_grad=True)
    lp, ent = token_logprobs(x, torch.tensor([[0, 2]]), torch.ones(1, 2), 0.5, with_entropy=True)
    assert lp[0, 1].item() == pytest.approx(math.log(0.25)) and ent[0, 1].item() == pytest.approx(math.log(4))
    (lp.sum() + 3.0 * ent.sum()).backward()
    expected = torch.tensor([[[-0.5, -0.5, 1.5, -0.5], [0.0, 0.0, 0.0, 0.0]]])
    torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("used", ["logprobs", "entropies"])
def test_a_loss_of_one_output_alone(used: str) -> None:
    """A loss of the log-probs alone or of the entropies alone (autograd hands the other output's
    gradient as zeros): the reference formulation's gradient."""
    g = torch.Generator().manual_seed(2)
    logits, ids = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    grads = []
    for fn in (token_logprobs, reference.token_logprobs):
        x = logits.clone().requires_grad_(True)
        lp, ent = fn(x, ids, torch.ones(2, 5), 0.8, with_entropy=True)
        (lp if used == "logprobs" else ent).sum().backward()
        grads.append(x.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-6)


def test_without_gradient_the_same_values() -> None:
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 5, 9, generator=g), torch.randint(0, 9, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    with torch.no_grad():
        lp, ent = token_logprobs(logits, ids, mask, 0.8, with_entropy=True)
    grad_lp, grad_ent = token_logprobs(logits.clone().requires_grad_(True), ids, mask, 0.8, with_entropy=True)
    assert torch.equal(lp, grad_lp.detach()) and torch.equal(ent, grad_ent.detach()) and not lp.requires_grad


def test_only_the_logits_and_per_token_values_are_kept_for_backward() -> None:
    """What backward keeps: the logits (the model's own output, not a copy) and a few values per
    token; the whole-tensor formulation keeps vocabulary-sized float32 tensors (``log p``, ``p``
    and their product). ``entropy_grad=False``: the same log-probs, entropies and log-prob
    gradient, and an entropy without gradient."""
    g = torch.Generator().manual_seed(0)
    b, t, vocab = 2, 6, 50
    logits = torch.randn(b, t, vocab, generator=g).bfloat16()
    ids = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    results = {}
    for grad in (True, False):
        x = logits.clone().requires_grad_(True)
        size, (lp, ent) = _saved_bytes(
            lambda x=x, grad=grad: token_logprobs(x, ids, mask, 0.7, with_entropy=True, entropy_grad=grad)
        )
        assert ent.requires_grad is grad
        lp.sum().backward()
        results[grad] = (size, lp.detach(), ent.detach(), x.grad)
    (size_on, lp_on, ent_on, grad_on), (size_off, lp_off, ent_off, grad_off) = results[True], results[False]
    assert torch.equal(lp_on, lp_off) and torch.equal(ent_on, ent_off) and torch.equal(grad_on, grad_off)
    logits_bytes, per_token = logits.numel() * logits.element_size(), 16 * b * t
    assert size_off <= size_on <= logits_bytes + per_token, (size_on, logits_bytes)
    reference_size, _ = _saved_bytes(
        lambda: reference.token_logprobs(logits.clone().requires_grad_(True), ids, mask, 0.7, with_entropy=True)
    )
    assert reference_size >= 3 * b * (t - 1) * vocab * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True])
def test_on_a_gpu_chunked_equals_the_whole_tensor_formulation(monkeypatch, autocast: bool) -> None:
    """On CUDA, bfloat16 logits over a Qwen-sized vocabulary in several chunks (inside an autocast
    region, as the engines' forwards with ``autocast_dtype`` run): the same values as the
    whole-tensor formulation, bfloat16 gradients within one rounding of it, and a lower peak."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 151936 * 96)
    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 2, 300, 151936
    logits = (torch.randn(rows, width, vocab, generator=g) * 3).bfloat16().cuda()
    ids = torch.randint(0, vocab, (rows, width), generator=g).cuda()
    mask = torch.ones(rows, width, dtype=torch.long, device="cuda")
    mask[1, 250:] = 0
    weights = (torch.randn(rows, width, generator=g).cuda(), torch.randn(rows, width, generator=g).cuda())
    out, peaks = {}, {}
    for name, fn in (("chunked", token_logprobs), ("reference", reference.token_logprobs)):
        x = logits.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = fn(x, ids, mask, 0.9, with_entropy=True)
            ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        out[name] = (lp.detach(), ent.detach(), x.grad)
    (lp, ent, grad), (ref_lp, ref_ent, ref_grad) = out["chunked"], out["reference"]
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-2, rtol=1e-2)
    assert peaks["chunked"] < peaks["reference"] / 2, peaks
