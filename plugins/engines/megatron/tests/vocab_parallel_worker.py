"""Worker of ``test_vocab_parallel.py``'s multi-rank test, launched by ``torchrun`` (gloo, CPU; no
megatron-core process groups: the tensor-parallel group is the whole world). For each case, every
rank takes its slice of the same padded logits, computes ``vocab_parallel_stats`` and the
gradient of a weighting of both outputs; the slices' gradients are gathered and compared with the
reference formulation on the whole (unpadded) vocabulary. Rank 0 writes the largest differences
of each case to ``--out`` (JSON)."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from core_rl.testing import reference
from core_rl_megatron.vocab_parallel import vocab_parallel_stats
from core_rl_train_kit import logprobs
from core_rl_train_kit.logprobs import align_to_tokens

#: (name, real vocabulary, padded vocabulary, temperature, dtype, entropy, entropy_grad, chunk)
CASES = [
    ("padded_last_slice", 29, 36, 0.7, torch.float32, True, True, None),
    ("one_row_chunks", 29, 36, 1.0, torch.float32, True, True, 5),
    ("a_slice_of_padding_only", 20, 36, 1.3, torch.float32, True, True, 7),
    ("bfloat16", 33, 36, 0.9, torch.bfloat16, True, True, 30),
    ("log_probs_only", 29, 36, 0.7, torch.float32, False, True, None),
    ("entropy_as_a_metric", 29, 36, 0.7, torch.float32, True, False, 12),
]


def run_case(vocab: int, padded: int, temperature: float, dtype, entropy: bool, entropy_grad: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(vocab * 1000 + padded)
    full = (torch.randn(3, 7, padded, generator=g) * 3).to(dtype)
    full[..., vocab:] = 1e4  # padding must never count, however large its logits
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    ref_logits = full[..., :vocab].clone().requires_grad_(True)
    ref_lp, ref_ent = reference.token_logprobs(ref_logits, ids, mask, temperature, with_entropy=entropy)
    (ref_lp * w_lp).sum().add((ref_ent * w_ent).sum() if entropy and entropy_grad else 0.0).backward()

    width = padded // world
    local = full[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    lp, ent = vocab_parallel_stats(
        local,
        targets,
        vocab_start=rank * width,
        vocab_size=vocab,
        temperature=temperature,
        with_entropy=entropy,
        entropy_grad=entropy_grad,
        group=dist.group.WORLD,
    )
    lp = align_to_tokens(lp[:, :-1], mask)
    loss = (lp * w_lp).sum()
    if entropy:
        ent = align_to_tokens(ent[:, :-1], mask)
        assert ent.requires_grad is entropy_grad
        if entropy_grad:
            loss = loss + (ent * w_ent).sum()
    else:
        assert ent is None
    loss.backward()
    assert local.grad.dtype == dtype
    grads = [torch.empty_like(local.grad) for _ in range(world)]
    dist.all_gather(grads, local.grad.contiguous())
    grad = torch.cat(grads, dim=-1).float()
    return {
        "logprob": (lp - ref_lp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item() if entropy else 0.0,
        "grad": (grad[..., :vocab] - ref_logits.grad.float()).abs().max().item(),
        "grad_padding": grad[..., vocab:].abs().max().item(),
        "same_on_every_rank": _same_everywhere(lp) and (not entropy or _same_everywhere(ent)),
    }


def _same_everywhere(values: torch.Tensor) -> bool:
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values.detach().contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {}
    default_chunk = logprobs.CHUNK_ELEMENTS
    for name, vocab, padded, temperature, dtype, entropy, entropy_grad, chunk in CASES:
        logprobs.CHUNK_ELEMENTS = chunk or default_chunk
        results[name] = run_case(vocab, padded, temperature, dtype, entropy, entropy_grad)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
