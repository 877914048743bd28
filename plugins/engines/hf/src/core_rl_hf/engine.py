"""The ``hf`` rollout engine: a transformers causal LM held in this process.

``generate`` orders prompts by length (so a chunk's prompts need little padding), splits the
``len(prompts) * n`` samples into chunks of at most ``max_batch_size`` (:func:`plan_chunks`),
generates each chunk with :func:`core_rl_hf.generation.generate_batch` (one prefill per distinct
prompt of the chunk), and returns the samples in prompt order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from core_rl.checkpointing import generator_state, set_generator_state
from core_rl.config.schema import RolloutConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.protocol import Sample

from core_rl_hf.config import HFRolloutConfig, resolve_device
from core_rl_hf.generation import Completion, generate_batch
from core_rl_hf.sampling import check_sampling
from core_rl_hf.weights import load_full_state_dict, read_safetensors_dir


def _ids(value: Any) -> list[int]:
    """``None``, an int or a list of ints -> a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def special_token_ids(model: Any, tokenizer: Any | None) -> tuple[list[int], int]:
    """``(eos_token_ids, pad_token_id)``.

    EOS ids: the union of the model's generation config ``eos_token_id`` (an int or a list) and
    the tokenizer's ``eos_token_id``. Pad id (only a filler under a zero attention mask): the
    tokenizer's, else the generation config's, else the first EOS id, else 0.
    """
    gen = getattr(model, "generation_config", None)
    eos = _ids(getattr(gen, "eos_token_id", None)) or _ids(getattr(model.config, "eos_token_id", None))
    if tokenizer is not None:
        eos += _ids(tokenizer.eos_token_id)
    eos = sorted(set(eos))
    pads = _ids(getattr(tokenizer, "pad_token_id", None)) + _ids(getattr(gen, "pad_token_id", None)) + eos
    return eos, (pads[0] if pads else 0)


def plan_chunks(prompt_lengths: Sequence[int], n: int, max_batch_size: int) -> list[list[tuple[int, int]]]:
    """Split the ``n`` samples of every prompt into as few chunks of at most ``max_batch_size``
    samples as possible.

    Returns chunks of ``(prompt index, count)``: the samples of all prompts, prompts ordered by
    length (so a chunk holds prompts of similar lengths), laid end to end and cut every
    ``max_batch_size`` samples: ``ceil(len(prompts) * n / max_batch_size)`` chunks, a prompt's
    samples possibly spread over consecutive chunks. Every prompt gets exactly ``n`` samples.
    """
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room = max_batch_size
    for i in sorted(range(len(prompt_lengths)), key=lambda i: prompt_lengths[i]):
        left = n
        while left:
            take = min(left, room)
            current.append((i, take))
            left, room = left - take, room - take
            if room == 0:
                chunks.append(current)
                current, room = [], max_batch_size
    if current:
        chunks.append(current)
    return chunks


class HFRolloutEngine(RolloutEngine):
    """Generates with a transformers ``AutoModelForCausalLM`` loaded from ``model_path``."""

    def __init__(self, model_path: str | Path, config: HFRolloutConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, config.dtype))
        self._model: torch.nn.Module | None = model.to(self.device).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError):  # a weights-only directory: fall back to the model's config
            tokenizer = None
        self.eos_token_ids, self.pad_token_id = special_token_ids(model, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.generator: torch.Generator | None = None
        if config.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._weight_version = 0

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("the hf rollout engine is closed")
        return self._model

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Sample]]:
        check_sampling(sampling)
        self._check_prompts(prompts)
        completions: list[list[Completion]] = [[] for _ in prompts]
        lengths = [len(p) for p in prompts]
        for chunk in plan_chunks(lengths, sampling.n, self.config.max_batch_size):
            outs = generate_batch(
                self.model,
                [prompts[i] for i, _ in chunk],
                [count for _, count in chunk],
                sampling,
                eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id,
                generator=self.generator,
            )
            for (i, _), out in zip(chunk, outs):
                completions[i].extend(out)
        return [
            [
                Sample(
                    prompt_ids=list(prompt),
                    response_ids=c.token_ids,
                    logprobs=c.logprobs,
                    weight_version=self._weight_version,
                    finish_reason=c.finish_reason,
                )
                for c in group
            ]
            for prompt, group in zip(prompts, completions)
        ]

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        load_full_state_dict(self.model, state_dict)
        self._weight_version = version

    def load_weights_from_path(self, path: str | Path, version: int) -> None:
        self.update_weights(read_safetensors_dir(path), version)

    def state_dict(self) -> dict[str, Any]:
        """The engine's own generator (``seed`` set) and the weight version; with ``seed: null``
        sampling draws from torch's global RNG, which the train engine checkpoints."""
        state: dict[str, Any] = {"weight_version": self._weight_version}
        if self.generator is not None:
            state["generator"] = generator_state(self.generator)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "generator" in state:
            if self.generator is None:
                raise ConfigError(
                    "rollout.engine.seed: not set, but the checkpoint holds the hf rollout engine's generator; "
                    "set it as in the run that saved the checkpoint"
                )
            set_generator_state(self.generator, state["generator"])
        elif self.generator is not None and state:
            raise ConfigError(
                "rollout.engine.seed: set, but the checkpoint holds no generator state for the hf rollout "
                "engine (the run that saved it had no seed); remove it to resume that run"
            )
        if "weight_version" in state:
            self._weight_version = int(state["weight_version"])

    def close(self) -> None:
        if self._model is not None:
            self._model = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def make_engine(rollout: RolloutConfig, engine_config: HFRolloutConfig | None, *, model_path: str) -> HFRolloutEngine:
    """The registered factory: ``rollout`` (sampling is passed to each ``generate`` call instead)
    is not needed; ``engine_config`` ``None`` means the defaults."""
    return HFRolloutEngine(model_path, engine_config if engine_config is not None else HFRolloutConfig())
