"""Log-prob / entropy alignment against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.engine_utils.logprobs import token_logprobs


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
    from core_rl.engine_utils.logprobs import align_to_tokens

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


def test_entropy_without_gradient_keeps_nothing_of_it_for_backward() -> None:
    """``entropy_grad=False``: the same log-probs and entropies, the same log-prob gradient, an
    entropy without gradient, and at least one ``[b, t, V]`` float32 tensor (the probabilities)
    fewer saved for backward."""
    g = torch.Generator().manual_seed(0)
    b, t, vocab = 2, 6, 50
    logits = torch.randn(b, t, vocab, generator=g)
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
    assert size_on - size_off >= b * (t - 1) * vocab * 4
