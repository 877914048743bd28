"""Worker of ``tests/test_ulysses.py``, launched by ``torchrun`` with 2 CPU processes (gloo), or with
``--device cuda`` one GPU each (NCCL).

Both ranks form one sequence-parallel group. For each case (attention implementation, layout,
fused head, grouped-query model, sliding window) every rank computes the group's log-probs and
entropies of one micro-batch and back-propagates the same loss of them; the gradients, summed over
the group, and the values must equal one process's unsharded forward (computed on every rank).
Rank 0 writes ``result.json`` with the largest differences of each case.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from core_rl.roles.hf import load_causal_lm
from core_rl_train_kit import ulysses
from core_rl_train_kit.packed import forward_logprobs
from core_rl_train_kit.sharded_forward import sharded_logprobs


def batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """5 rows of width 11 (odd: the group pads a column), one of them empty, one full."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (5, 11), generator=g)
    lengths = torch.tensor([11, 7, 1, 0, 4])
    mask = (torch.arange(11)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def loss_of(lp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(0.5, 1.5, lp.shape[1], device=lp.device)[None, :] * mask
    return (lp * weights).sum() + 0.3 * (ent * mask).sum()


def case(
    model_dir: str,
    inner: str,
    layout: str,
    fused: bool,
    sg: ulysses.SequenceGroup,
    device: torch.device,
    checkpointed: bool = False,
) -> dict[str, float]:
    ref = load_causal_lm(model_dir, dtype="float32", attn_implementation=inner).to(device)
    sharded = load_causal_lm(model_dir, dtype="float32", attn_implementation=ulysses.register(inner)).to(device)
    if checkpointed:  # backward recomputes each layer's forward, attention's exchanges included
        sharded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sharded.train()
    ids, mask = (t.to(device) for t in batch(len(inner) + 7 * fused, ref.config.vocab_size))
    kwargs = {"temperature": 0.8, "with_entropy": True, "layout": layout, "fused": fused}
    lp, ent = forward_logprobs(ref, ids, mask, **kwargs)
    loss_of(lp, ent, mask).backward()
    slp, sent = sharded_logprobs(sharded, ids, mask, sg, attn_implementation=inner, **kwargs)
    loss_of(slp, sent, mask).backward()
    worst = 0.0
    for p, q in zip(ref.parameters(), sharded.parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad, group=sg.group)
        worst = max(worst, float((grad - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)))
    return {
        "logprobs": float((slp - lp).abs().max()),
        "entropy": float((sent - ent).abs().max()),
        "grad_rel": worst,
        "loss": float(loss_of(slp, sent, mask)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    sg = ulysses.sequence_groups(dist.get_world_size())
    result: dict[str, dict[str, float]] = {}
    for model_dir in args.models:
        for inner in ("sdpa", "eager"):
            for layout in ("padded", "packed"):
                for fused in (False, True):
                    key = f"{Path(model_dir).name}/{inner}/{layout}/{'fused' if fused else 'logits'}"
                    result[key] = case(model_dir, inner, layout, fused, sg, device)
        result[f"{Path(model_dir).name}/sdpa/packed/checkpointed"] = case(
            model_dir, "sdpa", "packed", False, sg, device, checkpointed=True
        )
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, {k: v["loss"] for k, v in result.items()})
    if dist.get_rank() == 0:
        result["same_loss_on_every_rank"] = {"all": float(losses.count(losses[0]) == len(losses))}
        Path(args.out, "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()  # both ranks done before either tears its group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
