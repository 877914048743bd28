"""Training on one rank (CPU): the same 3 steps as ``fsdp`` (losses, entropies, gradient norms,
learning rates, final weights), and each memory / gradient-buffer setting that runs on CPU leaves
the step unchanged. Tolerances as in ``test_distributed.py``."""

from __future__ import annotations

from pathlib import Path

import mcore_common as common
import pytest
import torch
from core_rl.config.loader import structure
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.engine import MegatronEngine
from mcore_common import ON_GPU, same_metrics, same_weights


def engine(model: Path, **options: object) -> MegatronEngine:
    cfg = structure({"make_vocab_size_divisible_by": 8, **options}, MegatronConfig, path="actor.engine")
    return MegatronEngine(common.actor(str(model)), cfg)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[dict]:
    """3 steps with the default settings."""
    e = engine(tiny_model)
    metrics = common.train(e, range(3), 0, 1)
    e.close()
    return metrics


def test_three_steps_match_fsdp(tiny_model: Path, reference: list[dict]) -> None:
    pytest.importorskip("core_rl_fsdp")
    from core_rl_fsdp.engine import FSDPEngine

    fsdp = FSDPEngine(common.actor(str(tiny_model), "fsdp"))
    want = common.train(fsdp, range(3), 0, 1)
    same_metrics(reference, want, scale=ON_GPU)
    assert [m["lr"] for m in reference] == pytest.approx([0.01, 0.01, 0.007])  # warmup 1, linear decay
    mega = engine(tiny_model)
    common.train(mega, range(3), 0, 1)
    same_weights(mega.full_state_dict(), fsdp.full_state_dict())
    mega.close()
    fsdp.close()


@pytest.mark.parametrize(
    "options",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
        {"recompute_granularity": "selective"},
        {"ddp": {"grad_reduce_in_fp32": False, "bucket_size": 3000, "check_for_nan_in_grad": True}},
    ],
    ids=["recompute-full-uniform", "recompute-full-block", "recompute-selective", "ddp-buckets"],
)
def test_settings_leave_the_step_unchanged(tiny_model: Path, reference: list[dict], options: dict) -> None:
    e = engine(tiny_model, **options)
    same_metrics(common.train(e, range(2), 0, 1), reference[:2], scale=ON_GPU)
    e.close()


def test_actor_gradient_checkpointing_recomputes_every_layer(tiny_model: Path, reference: list[dict]) -> None:
    actor = common.actor(str(tiny_model))
    actor.gradient_checkpointing = True
    e = MegatronEngine(actor, MegatronConfig(make_vocab_size_divisible_by=8))
    assert (e.tconfig.recompute_granularity, e.tconfig.recompute_method, e.tconfig.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    same_metrics(common.train(e, range(1), 0, 1), reference[:1], scale=ON_GPU)
    e.close()


def test_non_finite_gradients_skip_the_update(tiny_model: Path) -> None:
    from core_rl.interfaces import LossOutput

    e = engine(tiny_model)
    before = e.full_state_dict()

    def nan_loss(batch, logprobs, entropy):
        return LossOutput(per_token_loss=logprobs * float("nan"))

    metrics = e.train_step(common.batches()[0], nan_loss)
    assert metrics["grad_norm"] != metrics["grad_norm"] and e.step == 1  # NaN; the step still counts
    after = e.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    e.close()


def test_an_attended_pad_token_trains_as_in_transformers(tiny_model: Path) -> None:
    """Hugging Face's embedding has ``padding_idx = pad_token_id``: a pad token among the attended
    tokens (a policy may sample one) sends no gradient to its row. One step with pad tokens inside
    the responses gives fsdp's update, and the pad row moves by the weight decay alone."""
    pytest.importorskip("core_rl_fsdp")
    from core_rl_fsdp.engine import FSDPEngine
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(tiny_model).pad_token_id
    batch = common.batches()[0]
    inside = batch["response_mask"].bool()
    inside[:, 1::2] = False  # every other response token becomes the pad token, attended as any other
    batch["input_ids"] = batch["input_ids"].masked_fill(inside, pad)
    assert bool(inside.any())
    engines = [engine(tiny_model), FSDPEngine(common.actor(str(tiny_model), "fsdp"))]
    before = engines[0].full_state_dict()["model.embed_tokens.weight"][pad]
    got, want = ([e.train_step(batch, common.nll, temperature=common.TEMPERATURE)] for e in engines)
    same_metrics(got, want, scale=ON_GPU)
    finals = [e.full_state_dict() for e in engines]
    same_weights(*finals)
    lr, wd = got[0]["lr"], 0.01  # AdamW's decoupled decay of a row without gradient
    torch.testing.assert_close(finals[0]["model.embed_tokens.weight"][pad], before * (1 - lr * wd))
    for e in engines:
        e.close()


def test_pending_state_bytes_are_what_the_first_step_allocates(tiny_model: Path) -> None:
    """What the engine tells the ``auto`` budget is still to come (its gradient buffers exist from
    the build) equals the optimizer state its first update creates; a frozen engine has none."""
    trained = engine(tiny_model)
    pending = trained.pending_state_bytes()
    assert pending > 0 and not trained.optimizer.state
    common.train(trained, range(1), 0, 1)
    created = sum(
        t.numel() * t.element_size()
        for _, state in trained.optimizer.state.items()  # a dict, or Megatron's ProxyDict (has no values())
        for t in state.values()
        if t.dim() > 0
    )
    assert pending == created
    trained.close()
    frozen = MegatronEngine(common.actor(str(tiny_model)), MegatronConfig(), trainable=False)
    assert frozen.pending_state_bytes() == 0
    frozen.close()


def test_weight_buckets_stay_on_the_engines_device_and_hold_full_state_dicts_weights(tiny_model: Path) -> None:
    """``weight_sync: memory`` reads the buckets where the engine keeps its weights: no tensor goes
    through host memory on the way (on a GPU a ``.cpu()`` per tensor would be a blocking copy each
    way); the buckets hold :meth:`full_state_dict`'s weights (its tied head aside)."""
    from core_rl.testing.weight_transfer import HostTrips

    e = engine(tiny_model)
    common.train(e, range(1), 0, 1)
    with HostTrips() as trips:
        buckets = list(e.hf_weight_buckets(bucket_bytes=4096))
    assert trips.calls == [] and len(buckets) > 1
    drawn = {k: v for bucket in buckets for k, v in bucket.items()}
    full = e.full_state_dict()
    assert set(full) - set(drawn) <= {"lm_head.weight"}
    assert all(torch.equal(drawn[k].to(full[k].device), full[k]) for k in drawn)  # a snapshot on the CPU
    e.close()
