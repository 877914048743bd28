"""The training run every comparison in these tests shares (engine, layout and process count vary):
3 AdamW steps with a linear schedule with warmup, weight decay and gradient clipping, on fixed
global batches of 7 rows split into 20-token micro-batches, with a supervised loss plus an entropy
bonus at temperature 0.9."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec, SchedulerConfig
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch

# Tolerances of the comparisons with fsdp and Hugging Face (float32 on CPU; see test_distributed.py).
LOGIT_ATOL, LOGPROB_ATOL = 1e-4, 1e-5
# relative: losses and entropies; gradient norms (after two AdamW steps the weights differ from
# fsdp's in the last bits, magnified as WEIGHT_ATOL says)
METRIC_REL = {
    "loss": 1e-6,
    "entropy": 1e-6,
    "neg_logprob": 1e-6,
    "grad_norm": 1e-5,
    "lr": 1e-12,
    "tokens": 0.0,
}
# Engines built in the test process run on the GPU where there is one: cuBLAS sums in other orders
# than the CPU kernels, so the relative tolerances of their comparisons with fsdp are ten times wider
# there (measured on an H100: losses 1.1e-6, gradient norms 1.9e-6, reward-model scores 1.4e-5).
ON_GPU = 10.0 if torch.cuda.is_available() else 1.0
# AdamW moves every element by up to lr (1e-2) per step whatever its gradient's size; for elements
# whose gradient is at rounding-noise level the direction depends on that noise, which a different
# reduction order (tensor parallelism splits the matmuls) changes. 3% of the learning rate.
WEIGHT_ATOL = 3e-4

# a Llama-3 rope scaling megatron-core can express (its built-in low/high frequency factors)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GLOBAL_ROWS = 7
WIDTH = 10  # make_rl_batch: prompt 4 + response up to 6
# rows of rank 0 per step with 2 data-parallel ranks (rank 1 takes the rest): 4/3, 6/1, 7/0
SPLITS = [4, 6, 7]
TEMPERATURE = 0.9


def nll(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Negative log-likelihood with an entropy bonus, so gradients flow through both statistics."""
    return LossOutput(per_token_loss=-logprobs - 0.1 * entropy, token_metrics={"neg_logprob": -logprobs.detach()})


def batches() -> list[TensorBatch]:
    return [make_rl_batch(batch_size=GLOBAL_ROWS, seed=s, max_response_len=6) for s in range(3)]


def my_rows(batch: TensorBatch, step: int, rank: int, world: int) -> TensorBatch:
    """This rank's rows when ``world`` ranks split the batch, as the trainer hands them out (the
    megatron engine pools them inside a model replica): 2 ranks split unevenly (``SPLITS``), more
    ranks take every ``world``-th row."""
    if world == 1:
        return batch
    if world > 2:
        return batch.rows(slice(rank, None, world))
    cut = SPLITS[step]
    return batch.rows(slice(0, cut) if rank == 0 else slice(cut, GLOBAL_ROWS))


def actor(model: str, engine: str = "megatron") -> ActorConfig:
    return ActorConfig(
        model_path=model,
        engine=PluginSpec(name=engine),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01),
        lr_scheduler=SchedulerConfig(name="linear", warmup_steps=1, total_steps=4, min_lr_ratio=0.1),
        micro_batch=MicroBatchConfig(max_tokens_per_mb=2 * WIDTH),
        grad_clip=0.5,
    )


def train(engine: TrainEngine, steps: range, rank: int, world: int) -> list[dict[str, float]]:
    data = batches()
    return [engine.train_step(my_rows(data[s], s, rank, world), nll, temperature=TEMPERATURE) for s in steps]


# -- value models (critics): the same batches with value targets, PPO's clipped value loss -------------

# (not ``value_clipped``: where the clip does not bind, ``V_old + (v - V_old)`` may differ from ``v``
# in the last bit, so which branch counts as larger is rounding noise there)
VALUE_KEYS = ("loss", "grad_norm", "lr", "tokens")


def value_batches() -> list[TensorBatch]:
    """:func:`batches` with ``returns`` (a fixed pattern over the response) and ``old_values``
    (what a critic gave before the update: here minus half the returns, so the clip binds where
    ``|returns| > 0.4`` while the values are near 0)."""
    out = []
    for batch in batches():
        width = batch["input_ids"].shape[1]
        batch["returns"] = torch.linspace(-1.0, 1.5, width)[None, :] * batch["response_mask"]
        batch["old_values"] = -batch["returns"] / 2
        out.append(batch)
    return out


def value_loss(batch: TensorBatch, values: torch.Tensor) -> LossOutput:
    """PPO's clipped Huber value loss (:func:`core_rl.ops.values.value_loss`) on the response."""
    from core_rl.ops.values import value_loss as clipped_value_loss

    per_token, clipped = clipped_value_loss(
        values, batch["old_values"], batch["returns"], eps_clip=0.2, loss="huber", huber_delta=0.5
    )
    on = batch["response_mask"]
    return LossOutput(per_token_loss=per_token * on, token_metrics={"value_clipped": clipped.float()})


def train_values(engine: TrainEngine, steps: range, rank: int, world: int) -> list[dict[str, float]]:
    data = value_batches()
    return [engine.train_value_step(my_rows(data[s], s, rank, world), value_loss) for s in steps]


def critic_run(engine: TrainEngine) -> dict:
    """One rank: values of the first batch before and after 3 value steps, the steps' metrics and
    the final weights of ``engine`` (closed afterwards)."""
    batch = value_batches()[0]
    out = {"start": engine.compute_values(batch), "metrics": train_values(engine, range(3), 0, 1)}
    out.update(values=engine.compute_values(batch), final=engine.full_state_dict())
    engine.close()
    return out


def full_logits(engine: TrainEngine, batch: TensorBatch) -> torch.Tensor:
    """Logits [B, T, V] over the real vocabulary from a megatron engine, the vocabulary slices of
    the tensor-parallel ranks gathered (for tests only: the engine itself never gathers them)."""
    import torch.distributed as dist
    from core_rl_megatron.batches import MicroBatch
    from megatron.core import parallel_state as mpu

    mb = MicroBatch.of(batch, range(batch.batch_size))
    with torch.no_grad():
        local = engine.model[0](**engine._inputs(mb).forward_kwargs())  # type: ignore[attr-defined]
    parts = [torch.empty_like(local) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : engine.spec.vocab_size]  # type: ignore[attr-defined]


def hf_logits(model_path: str, batch: TensorBatch) -> torch.Tensor:
    """Logits [B, T, V] of the Hugging Face model (float32) on ``batch``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def mean_nll(logits: torch.Tensor, batch: TensorBatch) -> float:
    """Mean next-token negative log-likelihood over real tokens (the language-model loss)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    real = batch["attention_mask"][:, 1:] != 0
    return float(nll[real].mean())


def same_metrics(
    got: list[dict],
    want: list[dict],
    *,
    exact: bool = False,
    scale: float = 1.0,
    keys: tuple[str, ...] = ("loss", "entropy", "neg_logprob", "grad_norm", "lr", "tokens"),
) -> None:
    """Step metrics ``keys`` equal (``exact``) or within ``METRIC_REL`` (times ``scale``)."""
    import pytest

    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for key in keys:
            if exact:
                assert g[key] == w[key], (step, key)
            else:
                assert g[key] == pytest.approx(w[key], rel=METRIC_REL[key] * scale, abs=1e-9), (
                    step,
                    key,
                    g[key],
                    w[key],
                )


def same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = WEIGHT_ATOL) -> None:
    assert got.keys() == want.keys()
    for key in want:
        diff = (got[key].float() - want[key].float()).abs().max().item()
        assert diff <= atol, f"{key}: max difference {diff} > {atol}"


def run_torchrun(script: Path, nproc: int, *args: str, timeout: float, cpu: bool) -> None:
    """:func:`core_rl.testing.launch.run_torchrun` (``--standalone``, one torch thread each, CPU
    ranks with ``cpu``, else one GPU each), failing the test with the output it had when it ran
    past ``timeout`` seconds."""
    from core_rl.testing.launch import run_torchrun as launch

    try:
        launch(script, nproc, *args, timeout=timeout, cpu=cpu)
    except subprocess.TimeoutExpired as exc:
        _fail(f"{script.name} did not finish within {timeout} s:\n{(exc.stderr or b'')[-6000:]!r}")


def _fail(message: str) -> None:
    import pytest

    pytest.fail(message)
