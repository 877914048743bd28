"""Memory and time of token log-probs and entropies over a large vocabulary: the chunked
computation train engines use (:func:`core_rl_train_kit.logprobs.token_logprobs`) against the
whole-tensor formulation autograd composes (:func:`core_rl.testing.reference.token_logprobs`),
``fused`` (``fused_head: true``, :mod:`core_rl_train_kit.fused_head`: from the hidden states and
the head's weight, the logits never whole), and, where ``core-rl-megatron`` is installed, that
engine's vocabulary-parallel computation on one rank (``vocab_parallel``: the same chunking, its
own forward formulas).

The workload is a language-model head and what follows it in a training forward and backward:
``logits = hidden @ W^T`` for ``--tokens`` tokens (one packed row) with a ``--hidden`` x ``--vocab``
head (default Qwen2.5-0.5B's: 896 x 151936) in ``--dtype``, then log-probs and entropies at
temperature 0.9, and the backward of ``sum(w lp) + 0.01 sum(H)`` to the hidden states and the head.
Each formulation runs in its own process (``--repeats`` timed runs after one untimed one) and
prints:

- ``peak``: the most memory in use above the inputs (on CUDA ``max_memory_allocated``; on a CPU the
  process's peak resident memory, ``VmHWM``, reset before each run);
- ``saved``: bytes autograd keeps for backward (``saved_tensors_hooks``), and per token;
- ``s``: seconds per forward and backward (median);
- whether the chunked log-probs and entropies equal the reference's, and the largest difference of
  the head's gradient (for ``fused`` and ``vocab_parallel``: the largest differences of all three).

    python benchmarks/logprob_memory.py [--tokens 2048] [--vocab 151936] [--hidden 896]
                                        [--dtype bfloat16] [--device auto] [--repeats 3]

``--smoke``: a small vocabulary and few tokens (the test suite runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

FORMULATIONS = ("reference", "chunked", "fused", "vocab_parallel")


def available() -> tuple[str, ...]:
    """The formulations this installation can run (``vocab_parallel`` needs ``core-rl-megatron``)."""
    import importlib.util

    has_megatron = importlib.util.find_spec("core_rl_megatron") is not None
    return tuple(f for f in FORMULATIONS if f != "vocab_parallel" or has_megatron)


def fused_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_head``: from the hidden states ``[T, H]`` and the head's weight, in ``token_logprobs``'
    alignment."""
    from core_rl_train_kit.fused_head import fused_head_stats
    from core_rl_train_kit.logprobs import align_to_tokens

    targets = torch.cat([ids[0, 1:], ids[0, :1]])
    lp, ent = fused_head_stats(hidden, weight, targets, temperature, with_entropy=True)
    return align_to_tokens(lp[None, :-1], mask), align_to_tokens(ent[None, :-1], mask)


def vocab_parallel_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The megatron engine's vocabulary-parallel log-probs on one rank (the whole vocabulary), in
    ``token_logprobs``' alignment."""
    from core_rl_megatron.vocab_parallel import vocab_parallel_stats
    from core_rl_train_kit.logprobs import align_to_tokens

    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    lp, ent = vocab_parallel_stats(
        logits, targets, vocab_start=0, vocab_size=logits.shape[-1], temperature=temperature, with_entropy=with_entropy
    )
    return align_to_tokens(lp[:, :-1], mask), None if ent is None else align_to_tokens(ent[:, :-1], mask)


def workload(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """The head's inputs, the same for every formulation (seeded)."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    return {
        "hidden": torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype),
        "weight": (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).to(device, dtype),
        "ids": torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device),
        "w": torch.randn(1, args.tokens, generator=g).to(device),
    }


def step(formulation: str, inputs: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward and backward; ``(saved bytes, log-probs, entropies, the head's gradient)``."""
    from core_rl.testing import reference
    from core_rl_train_kit.logprobs import token_logprobs

    fn = {
        "fused": None,
        "chunked": token_logprobs,
        "reference": reference.token_logprobs,
        "vocab_parallel": vocab_parallel_logprobs,
    }[formulation]
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(True)
    mask = torch.ones_like(inputs["ids"])
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if formulation == "fused":
            lp, ent = fused_logprobs(hidden, weight, inputs["ids"], mask, 0.9)
        else:
            logits = (hidden @ weight.T)[None]
            lp, ent = fn(logits, inputs["ids"], mask, 0.9, with_entropy=True)
            del logits
    ((lp * inputs["w"]).sum() + 0.01 * ent.sum()).backward()
    return saved[0], lp.detach(), ent.detach(), weight.grad


def host_peak() -> int:
    from core_rl.loops.memory import host_peak_rss_bytes

    return host_peak_rss_bytes()


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """This process's figures for ``args.only`` (printed as JSON by ``--only``)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    inputs = workload(args, device)
    step(args.only, inputs)  # untimed: allocator pools, kernels
    seconds = []
    peaks = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        else:
            from core_rl.loops.memory import reset_host_peak

            reset_host_peak()
            base = host_peak()
        start = time.perf_counter()
        saved, lp, ent, grad = step(args.only, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        else:
            peaks.append(host_peak() - base)
        seconds.append(time.perf_counter() - start)
        del grad
    _saved, lp, ent, grad = step(args.only, inputs)
    torch.save({"lp": lp.cpu(), "ent": ent.cpu(), "grad": grad.float().cpu()}, args.out)
    return {"peak": max(peaks), "saved": saved, "seconds": statistics.median(seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", choices=FORMULATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.tokens, args.vocab, args.hidden, args.repeats = 256, 4000, 64, 1
    if args.only:
        print(json.dumps(run_one(args)))
        return 0
    import tempfile
    from pathlib import Path

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in available():
            out = Path(tmp) / f"{name}.pt"
            cmd = [sys.executable, __file__, "--only", name, "--out", str(out)]
            for key in ("tokens", "vocab", "hidden", "dtype", "device", "repeats", "threads"):
                cmd += [f"--{key}", str(getattr(args, key))]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            rows[name]["results"] = torch.load(out)
    ref, got = rows["reference"]["results"], rows["chunked"]["results"]
    same = torch.equal(ref["lp"], got["lp"]) and torch.equal(ref["ent"], got["ent"])
    grad_diff = (ref["grad"] - got["grad"]).abs().max().item()
    print(
        f"log-probs and entropies, {args.tokens} tokens x {args.vocab} vocabulary (head {args.hidden}), "
        f"{args.dtype}, {args.device}, {args.threads} thread(s), median of {args.repeats}"
    )
    print(f"{'formulation':<14} {'peak MiB':>10} {'saved MiB':>10} {'saved B/token':>14} {'s':>8}")
    for name in rows:
        r = rows[name]
        print(
            f"{name:<14} {r['peak'] / 2**20:>10.1f} {r['saved'] / 2**20:>10.1f} "
            f"{r['saved'] // args.tokens:>14,} {r['seconds']:>8.3f}"
        )
    print(f"identical log-probs and entropies: {same}; largest head-gradient difference: {grad_diff:.2e}")
    for name in ("fused", "vocab_parallel"):
        if name not in rows:
            continue
        other = rows[name]["results"]
        diffs = {key: (ref[key] - other[key]).abs().max().item() for key in ("lp", "ent", "grad")}
        print(
            f"the {name} formulation against the reference: largest log-prob difference {diffs['lp']:.2e}, "
            f"entropy {diffs['ent']:.2e}, head gradient {diffs['grad']:.2e}"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
