"""The trainer's side of the weight-update group (``core_rl_server_kit.weight_group``) and the backend that
``weight_sync_backend: auto`` picks (``core_rl_server_kit.remote.weights.auto_weight_backend``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from core_rl.testing import preloaded
from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.weights import auto_weight_backend

SPLIT_CHECK = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from core_rl_server_kit import weight_group
    from core_rl_server_kit.processes import free_port

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default = c10d._get_default_group()
    default.bound_device_id = torch.device("cpu", 0)  # as a torchrun rank on a GPU binds its device

    def split(*args, **kwargs):
        raise AssertionError("the weight group was split from the trainer's default group")

    c10d._get_split_source = split
    pg = weight_group.init_group(
        "127.0.0.1", free_port("127.0.0.1"), 1, backend="gloo", group_name="weights", timeout_s=30
    )
    assert weight_group.broadcast_tensors(pg, [torch.ones(3)], "cpu") == 12
    assert default.bound_device_id == torch.device("cpu", 0)  # put back
    # torn down before exit: gloo's threads left running at interpreter exit can abort the process
    weight_group.destroy_group(pg)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_the_weight_group_is_not_split_from_a_bound_default_group() -> None:
    """A torchrun rank on a GPU binds its default group to its device; torch then builds further
    NCCL groups by splitting the default group's communicator, which would need every trainer
    rank and no server. The weight group is built with the default group unbound (then bound
    again). Checked on gloo, through torch's own decision: it asks for a split source only when
    the default group is bound."""
    proc = preloaded.run([sys.executable, "-c", SPLIT_CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("options", "variant", "backend"),
    [
        ({}, "cpu", "gloo"),
        ({}, "cuda", "gloo"),  # started here: on the trainer's first GPU
        ({"env": {"CUDA_VISIBLE_DEVICES": "1"}}, "cuda", "nccl"),  # started on a GPU of their own
        ({"urls": ["http://10.0.0.2:8000"]}, "cuda", "nccl"),  # elsewhere (or placed by a launcher)
        ({"urls": ["http://10.0.0.2:8000"]}, "cpu", "gloo"),
    ],
)
def test_auto_picks_nccl_only_for_gpu_servers_with_gpus_of_their_own(options, variant, backend) -> None:
    assert auto_weight_backend(ServerOptions(**options), variant) == backend


STREAM_SIDE = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    from core_rl_server_kit import weight_group

    rank, port, marker = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    pg = weight_group.init_group("127.0.0.1", port, 2, rank=rank, backend="gloo", group_name="w", timeout_s=60)
    sent = [torch.full((4,), float(k)) for k in range(3)]
    if rank == 0:
        weight_group.broadcast_tensors(pg, sent[:1], "cpu")
        deadline = time.monotonic() + 30
        while not marker.exists():  # the receiver has the first tensor before the second is sent
            assert time.monotonic() < deadline, "the receiver never took the first tensor alone"
            time.sleep(0.05)
        weight_group.broadcast_tensors(pg, sent[1:], "cpu")
    else:
        received = weight_group.receive_tensors(pg, ["a", "b", "c"], ["float32"] * 3, [[4]] * 3, "cpu")
        name, first = next(received)
        assert name == "a" and torch.equal(first, sent[0])
        marker.touch()
        name, second = next(received)
        assert name == "b" and torch.equal(second, sent[1])
        assert weight_group.drain(received) == 1  # the third, which a loader did not ask for
        Path(str(marker) + ".done").touch()
    if rank == 0:  # the store lives here: stay until the receiver is done
        done, deadline = Path(str(marker) + ".done"), time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    print("ok", flush=True)
    os._exit(0)  # not through gloo's teardown, which may abort while the peer's connection closes
    """
)


def test_tensors_are_received_one_at_a_time_as_asked_for(tmp_path) -> None:
    """The receiving side holds one received tensor at a time (a server's loader copies each into
    its parameter before asking for the next): the sender here sends the second tensor only once
    the receiver has taken the first alone, which a receiver that took everything first would not."""
    from core_rl_server_kit.processes import free_port

    port, marker = free_port("127.0.0.1"), tmp_path / "took-first"
    sides = [
        preloaded.Popen(
            [sys.executable, "-c", STREAM_SIDE, str(rank), str(port), str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = [side.communicate(timeout=120) for side in sides]
    for side, (out, err) in zip(sides, results):
        assert side.returncode == 0 and out.strip() == "ok", err[-3000:]


def test_a_group_forms_under_a_new_name_while_an_earlier_one_is_still_registered() -> None:
    """Each group gets a name never used before in the process: a group whose shutdown failed
    stays registered under its name, and a later group (another engine's, or the same engine's
    after a server restart) must still form. Two real gloo groups of one rank, in this process."""
    import torch
    from core_rl_server_kit import weight_group
    from core_rl_server_kit.processes import free_port

    names = [weight_group.new_group_name() for _ in range(3)]
    assert len(set(names)) == 3 and all(f"_{os.getpid()}_" in n for n in names)
    groups = []
    try:
        for _ in range(2):  # the first one stays registered while the second forms
            name = weight_group.new_group_name()
            groups.append(
                weight_group.init_group(
                    "127.0.0.1", free_port("127.0.0.1"), 1, backend="gloo", group_name=name, timeout_s=30
                )
            )
            assert weight_group.broadcast_tensors(groups[-1], [torch.ones(2)], "cpu") == 8
    finally:
        for group in groups:
            weight_group.destroy_group(group)
