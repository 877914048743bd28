"""``weight_sync: memory`` from a train engine to the embedded ``hf`` rollout engine on the same device
(:func:`core_rl.sync.weight_sync.sync_in_memory`): the weights go bucket by bucket from the
trainer's own tensors into the rollout engine's, in place, with no trip through host memory and no
copy but the rollout engine's one fused copy per bucket; afterwards the rollout engine holds exactly
the trainer's weights (rounded once where it keeps bfloat16). One rank here, two CPU ranks through
``weight_sync_worker.py``, and on a GPU the time a 0.36B model's sync takes."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.sync.buckets import nbytes
from core_rl.sync.weight_sync import sync_in_memory
from core_rl.testing import make_rl_batch
from core_rl.testing.weight_transfer import DataOps, HostTrips

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")

from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine
from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.engine import HFRolloutEngine

#: the fsdp engine's one-rank layouts: its plain module, and FSDP-wrapped (as bf16 mixed precision wraps it)
LAYOUTS = {"plain": {}, "sharded": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}
WORKER = Path(__file__).with_name("weight_sync_worker.py")
#: where the deepspeed tests run: DeepSpeed takes one device type per process, and on a GPU machine
#: an earlier test of the same worker process may have chosen CUDA
DEEPSPEED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("sync") / "model", seed=0)


def _trained(model_path: Path, device: str = "cpu", engine: str = "fsdp", **options: Any) -> TrainEngine:
    """An fsdp (or deepspeed) engine one optimizer step away from the weights on disk (so a sync
    changes something)."""
    actor = ActorConfig(
        model_path=str(model_path), engine=PluginSpec(name=engine), optimizer=OptimizerConfig(name="adamw", lr=1e-2)
    )
    if engine == "deepspeed":
        from core_rl_deepspeed.config import DeepSpeedConfig
        from core_rl_deepspeed.engine import DeepSpeedEngine

        built: TrainEngine = DeepSpeedEngine(actor, DeepSpeedConfig(device=device, **options))
    else:
        built = FSDPEngine(actor, FSDPConfig(device=device, **options))
    built.train_step(make_rl_batch(), lambda b, lp, ent: _nll(lp))
    return built


def _nll(logprobs: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=-logprobs)


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_copies_once_in_place_without_host_trips(model_path: Path, layout: str, rollout_dtype: str) -> None:
    engine = _trained(model_path, weight_bucket_mb=0.01, **LAYOUTS[layout])  # 10 KB buckets: several
    rollout = HFRolloutEngine(model_path, HFRolloutConfig(device="cpu", dtype=rollout_dtype))
    storage = {k: v.data_ptr() for k, v in rollout.model.state_dict().items()}
    buckets = list(engine.hf_weight_buckets())
    assert len(buckets) > 3
    params = {_local(p).data_ptr() for p in engine.model.parameters()}
    assert all(t.data_ptr() in params for b in buckets for t in b.values())  # the parameters themselves

    with HostTrips() as trips, DataOps() as ops:
        sent = sync_in_memory(engine, rollout, 3, contextlib.nullcontext())
    assert trips.calls == []
    assert ops.data_ops() == {"aten._foreach_copy_": len(buckets)}  # the rollout engine's copy, nothing else
    want = engine.full_state_dict()
    own = rollout.model.state_dict()
    assert ops.written["aten._foreach_copy_"] == nbytes(own.values())
    assert sent == nbytes(want.values())
    assert rollout.weight_version == 3
    assert {k: v.data_ptr() for k, v in own.items()} == storage  # in place
    for key, value in own.items():
        assert torch.equal(value, want[key].to(value.dtype)), key  # bit-exact, or rounded once to bfloat16
    rollout.close()
    engine.close()


def test_after_a_forward_that_left_parameters_unsharded_the_buckets_hold_the_float32_weights(model_path: Path) -> None:
    """With ``reshard_after_forward: false`` a forward without a backward (log-probs) leaves FSDP's
    unsharded bfloat16 copies registered; the buckets still carry the float32 weights."""
    options = {**LAYOUTS["sharded"], "reshard_after_forward": False}
    engine = _trained(model_path, weight_bucket_mb=0.01, **options)
    engine.compute_logprobs(make_rl_batch())
    drawn = {k: v for bucket in engine.hf_weight_buckets() for k, v in bucket.items()}
    want = engine.full_state_dict()
    assert drawn.keys() == want.keys()
    for key, value in drawn.items():
        assert value.dtype == torch.float32 and torch.equal(value, want[key]), key
    engine.close()


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_buckets_reach_the_rollout_engine_without_host_trips(model_path: Path, zero_stage: int) -> None:
    """DeepSpeed keeps its fp32 master weights in flat partitions, so each is assembled on the
    device; still nothing goes through host memory. (ZeRO-3's own gathering moves partitions with
    ``.to(<accelerator>)``, which on a CPU machine names the CPU: these recorders cannot tell it
    from a host trip there.)"""
    pytest.importorskip("core_rl_deepspeed")
    options = {"zero_stage": zero_stage, "mixed_precision": "bfloat16", "weight_bucket_mb": 0.01}
    engine = _trained(model_path, DEEPSPEED_DEVICE, engine="deepspeed", **options)
    rollout = HFRolloutEngine(model_path, HFRolloutConfig(device=DEEPSPEED_DEVICE))
    before = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    with HostTrips() as trips:
        sync_in_memory(engine, rollout, 2, contextlib.nullcontext())
    assert trips.calls == []
    want = engine.full_state_dict()
    own = rollout.model.state_dict()
    assert all(torch.equal(v, want[k].to(v.device)) for k, v in own.items())  # want: a snapshot on the CPU
    assert not all(torch.equal(v, before[k]) for k, v in own.items())  # the trained weights arrived
    rollout.close()
    engine.close()


@pytest.mark.parametrize("engine_name", ["fsdp", "deepspeed"])
def test_a_tied_weight_is_gathered_and_copied_once(tmp_path: Path, engine_name: str) -> None:
    """An output head tied to the input embedding is one parameter under two names: the buckets
    carry it once, the rollout engine copies it once (each byte of its weights written once) and
    still holds it under both names."""
    from core_rl.testing.tiny import build_tiny_model

    if engine_name == "deepspeed":
        pytest.importorskip("core_rl_deepspeed")
    tied = build_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    device = DEEPSPEED_DEVICE if engine_name == "deepspeed" else "cpu"
    engine = _trained(tied, device, engine=engine_name, weight_bucket_mb=0.01)
    rollout = HFRolloutEngine(tied, HFRolloutConfig(device=device))
    names = [k for bucket in engine.hf_weight_buckets() for k in bucket]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(set(names))
    own = rollout.model.state_dict()
    unique = {t.data_ptr(): t for t in own.values()}.values()
    with DataOps() as ops:
        sync_in_memory(engine, rollout, 1, contextlib.nullcontext())
    assert ops.written["aten._foreach_copy_"] == nbytes(unique)
    want = engine.full_state_dict()
    assert torch.equal(own["lm_head.weight"], want["model.embed_tokens.weight"].to(device))
    assert own["lm_head.weight"].data_ptr() == own["model.embed_tokens.weight"].data_ptr()
    rollout.close()
    engine.close()


def test_a_bucket_handed_over_is_not_held_while_the_next_is_gathered(model_path: Path) -> None:
    """Rank 0 holds one bucket at a time on the way (the trainer's bucketing, the sync's count and
    the rollout engine's copy each let go of a bucket before the next is gathered): at each
    gather no tensor of an earlier bucket is alive (each bucket is one tensor here)."""
    import weakref

    from core_rl.sync.buckets import bucketed

    source = {
        k: v.clone() for k, v in HFRolloutEngine(model_path, HFRolloutConfig(device="cpu")).model.state_dict().items()
    }
    gathered: list[weakref.ref] = []
    alive_at_gather: list[int] = []

    class Gathering:
        def hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
            def named() -> Iterator[tuple[str, torch.Tensor]]:
                for key, value in source.items():
                    alive_at_gather.append(sum(ref() is not None for ref in gathered))
                    tensor = value.clone()  # a gather: a new tensor each time
                    gathered.append(weakref.ref(tensor))
                    yield key, tensor
                    del tensor  # as a gather that yields its result without keeping it

            yield from bucketed(named(), 1)  # one tensor per bucket

    rollout = HFRolloutEngine(model_path, HFRolloutConfig(device="cpu"))
    sync_in_memory(Gathering(), rollout, 1, contextlib.nullcontext())  # type: ignore[arg-type]
    assert len(alive_at_gather) == len(source) > 3
    assert alive_at_gather == [0] * len(source)
    assert all(torch.equal(rollout.model.state_dict()[k], v) for k, v in source.items())
    rollout.close()


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_recorders_see_the_state_dict_path_through_host_memory(model_path: Path, layout: str) -> None:
    """What ``weight_sync: memory`` did before, and ``collective`` still does (a full state dict on
    the CPU), is seen by the same recorders: they are not blind to it."""
    engine = _trained(model_path, **LAYOUTS[layout])
    rollout = HFRolloutEngine(model_path, HFRolloutConfig(device="cpu"))
    with HostTrips() as trips:
        rollout.update_weights(engine.full_state_dict(), 1)
    assert len(trips.calls) >= len(rollout.model.state_dict()) - 1  # a tied weight may be moved once
    rollout.close()
    engine.close()


class _Engine:
    """A train engine's buckets, recording how many were drawn."""

    def __init__(self, count: int) -> None:
        self.count, self.drawn = count, 0

    def hf_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.count):
            self.drawn += 1
            yield {f"w{i}": torch.zeros(2)}


class _Failing:
    def update_weights_from_buckets(self, buckets: Any, version: int) -> None:
        next(iter(buckets))
        raise RuntimeError("the rollout engine broke")


def test_a_failing_rollout_engine_still_lets_every_bucket_be_drawn() -> None:
    """The main rank finishes the train engine's collectives (the other ranks are in them) before
    the rollout engine's error propagates; a rank without a rollout engine draws every bucket."""
    engine = _Engine(4)
    with pytest.raises(RuntimeError, match="broke"):
        sync_in_memory(engine, _Failing(), 1, contextlib.nullcontext())  # type: ignore[arg-type]
    assert engine.drawn == 4
    other = _Engine(4)
    assert sync_in_memory(other, None, 1, contextlib.nullcontext()) == 0.0  # type: ignore[arg-type]
    assert other.drawn == 4


def test_two_ranks_gather_bucket_by_bucket_to_rank_0(model_path: Path, tmp_path: Path) -> None:
    from core_rl.testing.launch import run_torchrun

    run_torchrun(WORKER, 2, str(model_path), str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert ranks[0]["host_trips"] == ranks[1]["host_trips"] == 0
    assert ranks[0]["buckets"] == ranks[1]["buckets"] > 3  # the same gathers on both ranks
    assert ranks[0]["bucket_names"] > 0 and ranks[1]["bucket_names"] == 0  # kept on rank 0 only
    assert ranks[0]["sent"] == result["full_bytes"] and ranks[1]["sent"] == 0
    assert result["mismatched"] == [] and result["version"] == 1
    assert result["changed_by_training"]


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sync_of_a_036b_model_takes_under_a_tenth_of_a_second(tmp_path: Path) -> None:
    """The workload of benchmarks/gpu_grpo.py: a 0.36B Qwen2-shaped model trained with bf16 mixed
    precision (fp32 master weights) and the hf engine beside it on the same GPU."""
    from core_rl.testing.tiny import QWEN2_SHAPES, build_tiny_model

    path = build_tiny_model(tmp_path / "model", architecture="qwen2", tie_word_embeddings=True, **QWEN2_SHAPES["0.5b"])
    engine = _trained(path, device="cuda", **LAYOUTS["sharded"])
    rollout = HFRolloutEngine(path, HFRolloutConfig(device="cuda"))
    assert sum(p.numel() for p in rollout.model.parameters()) > 0.3e9
    times = []
    for version in range(1, 5):
        with HostTrips() as trips:
            start = time.perf_counter()
            sync_in_memory(engine, rollout, version, contextlib.nullcontext())
            times.append(time.perf_counter() - start)  # the hf engine synchronises the device
        assert trips.calls == []
    want = engine.full_state_dict()
    for key, value in rollout.model.state_dict().items():
        assert torch.equal(value.cpu(), want[key].to(value.dtype)), key
    print(f"sync of a 0.36B model on {torch.cuda.get_device_name()}: {[round(t, 4) for t in times]} s")
    assert statistics.median(times[1:]) < 0.1, times
    rollout.close()
    engine.close()
