"""Supervised warm start through the train engine: a few steps of next-token loss on
format-only targets (:func:`task.format_only_answer`), then export as a Hugging Face model.

It uses the same plugin host and ``fsdp`` engine as RL training, with a loss function that is the
negative log-likelihood of the response tokens."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from core_rl.config.loader import structure
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.kinds import TRAIN_ENGINE
from core_rl.ops import aggregation_weights
from core_rl.plugins import PluginHost
from core_rl.protocol import Sample, TensorBatch, samples_to_batch


def nll_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Per-token negative log-likelihood."""
    return LossOutput(per_token_loss=-logprobs)


def sft_batch(tokenizer, strings: list[str], rng: random.Random) -> TensorBatch:
    from task import format_only_answer, prompt_text

    samples = []
    for s in strings:
        prompt = tokenizer(prompt_text(s))["input_ids"]
        response = tokenizer(format_only_answer(s, rng), add_special_tokens=False)["input_ids"]
        response = [*response, tokenizer.eos_token_id]
        samples.append(Sample(prompt, response, [0.0] * len(response), 0, "stop"))
    batch = samples_to_batch(samples, list(range(len(samples))), tokenizer.pad_token_id)
    batch["loss_weight"] = aggregation_weights(batch["response_mask"], "token-mean")
    return batch


def warm_start(model_dir: Path, out_dir: Path, *, steps: int, batch_size: int, lr: float, seed: int) -> float:
    """Train ``model_dir`` for ``steps`` steps and export it to ``out_dir``; return the last loss."""
    from task import all_strings
    from transformers import AutoTokenizer

    host = PluginHost()
    entry = host.get(TRAIN_ENGINE, "fsdp")
    actor = ActorConfig(
        model_path=str(model_dir),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="adamw", lr=lr),
    )
    engine = entry.factory(actor, structure({}, entry.config_cls), trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    strings = all_strings()
    loss = float("nan")
    for _ in range(steps):
        loss = engine.train_step(sft_batch(tokenizer, rng.sample(strings, batch_size), rng), nll_loss)["loss"]
    engine.export_hf(out_dir)
    engine.close()
    return loss
