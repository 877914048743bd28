"""``core_rl.launch.distributed.all_reduce`` over a real gloo group: the sum and maximum over two
ranks, and in a group of one rank the values as they are without a call into the backend (the
single-process runs' step metrics and micro-batch plans reduce every step)."""

from __future__ import annotations

import sys
from pathlib import Path

from core_rl.testing import preloaded
from core_rl.testing.launch import cpu_ranks_env, run_torchrun

#: each rank reduces ``[rank + 1, 10 * (rank + 1)]`` by SUM and by MAX and prints both
WORKER = """
import sys

import torch
import torch.distributed as dist
from core_rl.launch.distributed import ReduceOp, all_reduce, ensure_process_group

rank, world = ensure_process_group("gloo", torch.device("cpu"))
if world == 1:
    def refuse(*args, **kwargs):
        raise AssertionError("dist.all_reduce called in a group of one rank")
    dist.all_reduce = refuse
values = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
same = all_reduce(values)
assert same is values
summed = all_reduce(torch.tensor([rank + 1.0, 10.0 * (rank + 1)])).tolist()
largest = all_reduce(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]), ReduceOp.MAX).tolist()
sys.stdout.write(f"rank {rank} sum {summed} max {largest}\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
"""


def _lines(output: str) -> set[str]:
    return {line for line in output.splitlines() if line.startswith("rank ")}


def test_two_ranks_sum_and_take_the_maximum(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = run_torchrun(script, 2)
    assert _lines(proc.stdout) == {
        "rank 0 sum [3.0, 30.0] max [2.0, 20.0]",
        "rank 1 sum [3.0, 30.0] max [2.0, 20.0]",
    }, proc.stdout + proc.stderr


def test_one_rank_keeps_the_values_without_calling_the_backend() -> None:
    proc = preloaded.run(
        [sys.executable, "-c", WORKER], env=cpu_ranks_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _lines(proc.stdout) == {"rank 0 sum [1.0, 10.0] max [1.0, 10.0]"}, proc.stdout
