"""ZeRO-3 models built partitioned (:mod:`core_rl_deepspeed.partitioned_load`), on 2 CPU ranks: each
rank holds half of every parameter and nothing whole, the gathered values are the ordinary load's (a
value head the directory lacks starts at zero), loading draws nothing from the global RNG, and a later
load in the same process builds an ordinary model again."""

from __future__ import annotations

import json
from pathlib import Path

from core_rl.testing.launch import run_torchrun

WORKER = Path(__file__).with_name("partitioned_load_worker.py")


def test_two_ranks_load_a_model_already_partitioned(tiny_model: Path, tmp_path: Path) -> None:
    run_torchrun(WORKER, 2, "--model", str(tiny_model), "--out", str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for found in ranks:
        for head in ("lm", "value"):
            assert found[f"{head}/local_elements"] == 0, found  # no parameter whole on any rank
            full, shard = found[f"{head}/full_elements"], found[f"{head}/shard_elements"]
            assert full / 2 <= shard <= full / 2 + 1024, found  # half of each (padded to the ranks)
            assert found[f"{head}/rng_untouched"] and not found[f"{head}/zero3_after"], found
        assert found["lm/differs"] == [], found
        assert found["value/head"] == ["score.bias", "score.weight"], found
        assert found["value/head_abs_sum"] == 0.0 and found["value/backbone_differs"] == [], found
        assert found["later_load_whole"], found
