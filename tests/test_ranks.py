"""Agreement points between ranks over a real 2-process gloo group: a failure on one rank stops
every rank with its message (and exit status), a signal on one rank stops every rank, rank 0's
payload or failure reaches the others, and a rank that does not answer makes the other fail
after the configured timeout with an error naming what it waited for."""

from __future__ import annotations

import json

import torch.multiprocessing as mp
from fault_helpers import ranks_worker


def test_agreement_points_over_two_processes(tmp_path):
    mp.start_processes(ranks_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["build"] == ["ValueError", "boom", None]  # rank 0 raises its own error
    assert r1["build"] == [
        "PeerFailure",
        "rank 0 failed: ValueError: boom (the traceback is in that rank's output)",
        1,
    ]
    assert r1["config"][0] == "ConfigError"
    assert r0["config"][0] == "PeerFailure" and r0["config"][2] == 2  # the config error's exit status
    assert r0["config"][1].startswith("rank 1 failed: invalid configuration:")
    assert r0["stop"] == r1["stop"] == ["ok", "SIGTERM"]
    assert r0["send"] == r1["send"] == ["ok", "batch"]
    assert r0["send_failed"] == ["RewardError", "broke", 1]
    assert r1["send_failed"] == ["PeerFailure", "rank 0 failed: broke", 1]
    assert r0["timeout"][0] == "CollectiveTimeout"
    assert r0["timeout"][1].startswith("rank 0: waited more than 2 s for the other ranks to finish step 5")
    assert r1["timeout"][0] == "CollectiveTimeout" and r1["timeout"][1].startswith("rank 1: ")
