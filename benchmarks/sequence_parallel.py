"""Activation memory and time of one long sequence's forward and backward, with Ulysses sequence
parallelism over 1, 2, ... ranks (:mod:`core_rl_train_kit.ulysses`) and without.

The workload: one row of ``--tokens`` tokens through a random-weight causal LM (``core_rl.testing.tiny``,
Llama layout, ``--hidden`` x ``--layers``, ``--heads`` heads), float32, SDPA attention; log-probs
and entropies at temperature 1 and the backward of ``sum(lp) + 0.01 sum(H)``. For each group size
``n`` in ``--sizes``, ``torchrun`` starts ``n`` CPU processes (gloo) that form one group (``n = 1``:
the unsharded forward, :func:`core_rl_train_kit.packed.forward_logprobs`); for every rank it prints

- ``saved``: bytes autograd keeps for backward on that rank (``saved_tensors_hooks``), the
  activation memory that sequence parallelism divides;
- ``peak``: the rank's peak resident memory above what it held before the step (``VmHWM``, reset
  first; includes the temporaries of attention over the whole sequence);
- ``s``: seconds per forward and backward (median of ``--repeats`` after one untimed run; on a
  shared CPU the ranks compete for cores, so this is no GPU figure).

    python benchmarks/sequence_parallel.py [--tokens 8192] [--sizes 1,2] [--hidden 256] [--layers 4]

``--smoke``: a short row (the test suite runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _resident_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(args: argparse.Namespace) -> None:
    """One rank: the step's figures in ``--results/rank<r>.json`` (a file each: the ranks share
    torchrun's standard output, where their lines could interleave)."""
    import torch
    import torch.distributed as dist
    from core_rl.roles.hf import load_causal_lm
    from core_rl_train_kit import ulysses
    from core_rl_train_kit.packed import forward_logprobs
    from core_rl_train_kit.sharded_forward import sharded_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size = dist.get_world_size()
    sg = ulysses.sequence_groups(size)
    attn = ulysses.register("sdpa") if size > 1 else "sdpa"
    model = load_causal_lm(args.model, dtype="float32", attn_implementation=attn)
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def step() -> int:
        saved = 0

        def keep(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        kwargs = {"temperature": 1.0, "with_entropy": True}
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            if size == 1:
                lp, ent = forward_logprobs(model, ids, mask, **kwargs)
            else:
                lp, ent = sharded_logprobs(model, ids, mask, sg, attn_implementation="sdpa", **kwargs)
        (lp.sum() + 0.01 * ent.sum()).backward()
        model.zero_grad(set_to_none=True)
        return saved

    step()
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        before = _resident_mib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        saved = step()
        times.append(time.perf_counter() - start)
        peak = _resident_mib("VmHWM") - before
    figures = {"size": size, "rank": dist.get_rank(), "saved_mib": saved / 2**20, "peak_mib": peak}
    figures["s"] = statistics.median(times)
    Path(args.results, f"rank{dist.get_rank()}.json").write_text(json.dumps(figures))
    dist.barrier()
    dist.destroy_process_group()


def run_size(size: int, model: Path, args: argparse.Namespace) -> list[dict]:
    """The figures of every rank of one group of ``size``."""
    from core_rl.testing.launch import cpu_ranks_env, elastic_logs

    env = cpu_ranks_env({**os.environ, "OMP_NUM_THREADS": "1"})
    results = model.parent / f"results-{size}"
    results.mkdir()
    with elastic_logs() as logs:  # torchrun's own log folder, removed with the group
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}"]
        cmd += [f"--log-dir={logs}", __file__]
        cmd += ["--worker", "--model", str(model), "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        cmd += ["--results", str(results)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"group of {size} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(size)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.tokens, args.hidden, args.layers, args.repeats = 512, 64, 2, 1
    from core_rl.testing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=max(256, args.tokens),
            seed=0,
        )
        print(f"one row of {args.tokens} tokens, hidden {args.hidden}, {args.layers} layers, float32, sdpa, CPU")
        print(f"{'group':>5} {'rank':>4} {'saved MiB':>10} {'peak MiB':>9} {'s':>7}")
        for size in (int(s) for s in args.sizes.split(",")):
            for r in run_size(size, model, args):
                print(f"{size:>5} {r['rank']:>4} {r['saved_mib']:>10.1f} {r['peak_mib']:>9.1f} {r['s']:>7.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
