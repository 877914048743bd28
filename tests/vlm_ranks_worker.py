"""A ``torchrun`` worker of ``tests/test_vlm.py``: two ranks of a tiny VLM on a train engine
(``fsdp``, or ``deepspeed`` with ``-zeroN``: the fourth argument, :func:`train_engine`), rank 0 with
a text-only row, rank 1 with a row holding an image; each computes log-probs and takes a train step
(the vision tower's sharded units must line up: ``core_rl_train_kit.vision_tower``). Rank ``r``
writes ``rank{r}.json`` (its log-probs and loss) into the folder given as the second argument; the
third names a JSON file with the image row's ``prompt``, ``pixel_values`` and ``image_grid_thw``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput
from core_rl.protocol import Sample, samples_to_batch


def train_engine(spec: str, model: Path, *, lr: float = 0.1, **actor: object):
    """A trainable engine of ``spec`` (``fsdp``, ``deepspeed``, ``deepspeed-zero3``: the ZeRO stage,
    2 by default) on ``model``, SGD at ``lr``, other ``actor`` keys as given."""
    name, _, stage = spec.partition("-zero")
    config = ActorConfig(
        model_path=str(model), engine=PluginSpec(name=name), optimizer=OptimizerConfig(name="sgd", lr=lr), **actor
    )
    if name == "fsdp":
        from core_rl_fsdp.config import FSDPConfig
        from core_rl_fsdp.engine import FSDPEngine

        return FSDPEngine(config, FSDPConfig(), trainable=True)
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(config, DeepSpeedConfig(zero_stage=int(stage or 2)), trainable=True)


def main(model: Path, out: Path, prompt: list[int], media: dict[str, torch.Tensor], engine_spec: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if rank == 1:
        samples = [Sample(prompt, [7, 8], [-1.0, -1.0], 0, "stop", media=media)]
    else:
        samples = [Sample([1, 9, 10, 11], [7, 8], [-1.0, -1.0], 0, "stop")]
    batch = samples_to_batch(samples, [0], pad_token_id=0)
    batch["loss_weight"] = batch["response_mask"] / 4
    engine = train_engine(engine_spec, model)
    logprobs = engine.compute_logprobs(batch)
    metrics = engine.train_step(batch, lambda mb, lp, ent: LossOutput(per_token_loss=-lp))
    (out / f"rank{rank}.json").write_text(json.dumps({"logprobs": logprobs[0].tolist(), "loss": metrics["loss"]}))
    engine.close()


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[3]).read_text())
    engine_spec = sys.argv[4] if len(sys.argv) > 4 else "fsdp"
    media = {"pixel_values": torch.tensor(spec["pixel_values"]), "image_grid_thw": torch.tensor(spec["image_grid_thw"])}
    main(Path(sys.argv[1]), Path(sys.argv[2]), spec["prompt"], media, engine_spec)
