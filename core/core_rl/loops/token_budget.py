"""The ``auto`` micro-batch token budget (``<role>.micro_batch.max_tokens_per_mb: auto``), as pure
functions of a few numbers (no torch): the core resolves it once at the start of a run
(:mod:`core_rl.loops.auto_budget`), where each role's engine knows its device.

On a CPU the budget is the tokens whose activations fill :data:`CPU_ACTIVATION_BYTES` (256 MiB),
between :data:`CPU_TOKENS_PER_MB` (768) and :data:`CPU_MAX_TOKENS_PER_MB` (2048)::

    budget = clamp(floor_128(CPU_ACTIVATION_BYTES / bytes_per_token), 768, 2048)

There memory is rarely what bounds a micro-batch; its speed is. A micro-batch of SmolLM2-135M
(822 KiB of activations a token in bfloat16) or a larger model holds enough work at 768 tokens for
its matrix products to run near full speed, and more only costs memory and cache (the 135M
model's update: 7.47 s a step at 768, 7.72 s at 1536), so such models get 768. A narrow model's
768-token micro-batch is small enough that each one's fixed costs show (its Python, the compiled
graph's call, the log-prob head's chunks): the medium CPU benchmark model (3.2M parameters,
hidden size 256) updated in 0.36 s at 768 and 0.33 s at 1536 to 3072, so models this small get
up to 2048. A model whose shape is unknown gets 768. On a GPU it is what fits in the memory left
free, with half of it kept in reserve::

    budget = clamp(floor_128(ACTIVATION_SHARE x (free - pending) / bytes_per_token),
                   GPU_MIN_TOKENS_PER_MB, GPU_MAX_TOKENS_PER_MB)

- ``free``: the device's free memory once every model of the run is built (their weights are in),
  plus what torch's caching allocator holds unused; the least over the ranks;
- ``pending``: what the trained roles on that device allocate at their first optimiser step:
  their gradients and optimiser state (:func:`pending_state_bytes`: with AdamW, 3 x the weights'
  bytes on this rank, measured while each engine was built, so sharding and offloading count),
  or what the engine itself says (a ``pending_state_bytes()`` method: the ``megatron`` engine's
  gradient buffers and float32 master copies exist from its build, so only the optimiser's
  state is still to come);
- ``bytes_per_token``: the activations one token of a micro-batch keeps for backward
  (:func:`activation_bytes_per_token`): per decoder layer ``8 x hidden + 4 x intermediate`` values
  in the compute dtype, plus, for a language-model head, the vocabulary-sized logits in the compute
  dtype and their gradient when backward reaches them (the log-probs and entropies of
  :mod:`core_rl_train_kit.logprobs` keep nothing else of the vocabulary's size: their float32
  work is one chunk at a time, whatever the micro-batch; so do the ``megatron`` engine's
  vocabulary-parallel ones);
- :data:`ACTIVATION_SHARE` (0.5): the other half covers what the estimate leaves out: temporaries,
  the allocator's fragmentation, the embedded rollout engine's KV cache, an unsharded FSDP unit;
- rounded down to a multiple of :data:`TOKEN_ROUNDING` (128) and clamped to
  [:data:`GPU_MIN_TOKENS_PER_MB`, :data:`GPU_MAX_TOKENS_PER_MB`] = [1024, 16384] (16384 is
  verl's default per GPU; OpenRLHF's is 16192 and AReaL's 10240).

The same formula serves a frozen role (no gradients, nothing kept for backward): its budget is
then conservative. An engine used outside a run (tests, the conformance kit) that meets an
unresolved ``auto`` takes the CPU figure (:func:`tokens_per_mb`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.model_sections import AUTO as AUTO  # re-exported beside the formulas

#: the least budget on a CPU, and its budget for a model of unknown shape
CPU_TOKENS_PER_MB = 768
#: the largest budget on a CPU
CPU_MAX_TOKENS_PER_MB = 2048
#: the activations one micro-batch may keep on a CPU
CPU_ACTIVATION_BYTES = 256 * 2**20
#: the least budget ``auto`` gives on a GPU
GPU_MIN_TOKENS_PER_MB = 1024
#: the largest budget ``auto`` gives on a GPU (verl's default per GPU)
GPU_MAX_TOKENS_PER_MB = 16384
#: ``auto`` budgets are multiples of this
TOKEN_ROUNDING = 128
#: the share of the usable free memory one micro-batch's activations may take
ACTIVATION_SHARE = 0.5
#: bytes per value of the dtypes a forward computes in
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@attrs.frozen
class ModelShape:
    """The sizes of a decoder-only transformer that the activation estimate needs."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """The shape in a Hugging Face ``config.json`` (its ``text_config`` for a multimodal one);
        ``None`` when it names no layer count or hidden size. ``intermediate`` defaults to
        ``4 x hidden``, ``vocab`` to 0."""
        config = config.get("text_config") or config
        layers = _first_int(config, ("num_hidden_layers", "n_layer", "num_layers"))
        hidden = _first_int(config, ("hidden_size", "n_embd", "d_model"))
        if not layers or not hidden:
            return None
        intermediate = _first_int(config, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
        return cls(layers, hidden, intermediate, _first_int(config, ("vocab_size",)) or 0)

    @property
    def estimated_parameters(self) -> int:
        """About how many parameters a model of this shape has: ``layers x (4 hidden^2 + 3 hidden
        x intermediate) + vocab x hidden`` (full attention, a gated MLP, tied embeddings)."""
        per_layer = 4 * self.hidden**2 + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden


def _first_int(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def checkpointed_layers(layers: int, every_n_layers: int) -> int:
    """How many of ``layers`` decoder layers recompute their activations when every
    ``every_n_layers``-th one does (layers ``0, n, 2n, ...``)."""
    return len(range(0, layers, max(1, every_n_layers)))


def activation_bytes_per_token(
    shape: ModelShape,
    *,
    compute_bytes: int,
    lm_head: bool = True,
    checkpointed: int = 0,
    offload: bool = False,
    fused_head: bool = False,
) -> int:
    """Bytes one token of a micro-batch keeps for backward (see the module docstring).

    A layer keeps ``(8 x hidden + 4 x intermediate) x compute_bytes``: its norms' inputs, the
    query/key/value and attention outputs, and the MLP's gate, up, activation and product. Of the
    ``checkpointed`` layers only the input (``hidden`` values) stays (none on the device with
    ``offload``), plus one layer's activations while it is recomputed. A language-model head
    (``lm_head``) adds ``vocab x 2 x compute_bytes``: the logits and their gradient (the log-prob
    computation keeps no float32 tensor of the vocabulary's size), or with ``fused_head``
    (:mod:`core_rl_train_kit.fused_head`: no logits) the ``hidden`` values it keeps; a value or
    score head one value."""
    per_layer = (8 * shape.hidden + 4 * shape.intermediate) * compute_bytes
    checkpointed = min(max(checkpointed, 0), shape.layers)
    kept = (shape.layers - checkpointed) * per_layer
    if checkpointed:
        kept += (0 if offload else checkpointed * shape.hidden * compute_bytes) + per_layer
    if not lm_head:
        head = compute_bytes
    else:
        head = (shape.hidden if fused_head else 2 * shape.vocab) * compute_bytes
    return kept + head


def pending_state_bytes(weight_bytes: int, *, optimizer: str, momentum: float = 0.0, lora: bool = False) -> int:
    """Device memory a trained role allocates at its first optimiser step, for ``weight_bytes`` of
    weights on the device: a gradient per weight plus the optimiser's state (AdamW two moments,
    SGD one with momentum, none without), each the weights' size; 0 for LoRA (only the small
    adapters train)."""
    if lora:
        return 0
    return weight_bytes * (1 + optimizer_states(optimizer, momentum))


def optimizer_states(optimizer: str, momentum: float = 0.0) -> int:
    """Tensors the optimiser keeps per parameter, each its size: AdamW two moments, SGD one
    momentum buffer with ``momentum > 0``, none without; at most: Adafactor one (a vector's
    second moment; a matrix's is two small vectors), Muon two (AdamW's; Muon's matrices one),
    a ``class`` optimizer assumed two."""
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    return 1 if optimizer == "adafactor" else 2


def gpu_token_budget(usable_bytes: int, bytes_per_token: int) -> int:
    """The ``auto`` budget on a GPU with ``usable_bytes`` (free minus pending) for activations of
    ``bytes_per_token`` each: ``ACTIVATION_SHARE`` of it, in tokens, rounded down to a multiple of
    ``TOKEN_ROUNDING`` and clamped to ``[GPU_MIN_TOKENS_PER_MB, GPU_MAX_TOKENS_PER_MB]``."""
    share = int(max(usable_bytes, 0) * ACTIVATION_SHARE)
    return tokens_filling(share, bytes_per_token, GPU_MIN_TOKENS_PER_MB, GPU_MAX_TOKENS_PER_MB)


def cpu_token_budget(bytes_per_token: int) -> int:
    """The ``auto`` budget on a CPU for activations of ``bytes_per_token`` each: the tokens whose
    activations fill :data:`CPU_ACTIVATION_BYTES`, rounded down to a multiple of ``TOKEN_ROUNDING``
    and clamped to ``[CPU_TOKENS_PER_MB, CPU_MAX_TOKENS_PER_MB]``."""
    return tokens_filling(CPU_ACTIVATION_BYTES, bytes_per_token, CPU_TOKENS_PER_MB, CPU_MAX_TOKENS_PER_MB)


def tokens_filling(activation_bytes: int, bytes_per_token: int, least: int, most: int) -> int:
    """``clamp(floor_128(activation_bytes / bytes_per_token), least, most)``: the tokens whose
    activations of ``bytes_per_token`` each fit in ``activation_bytes``, rounded down to a multiple
    of ``TOKEN_ROUNDING`` and clamped to ``[least, most]``."""
    tokens = max(activation_bytes, 0) // max(bytes_per_token, 1)
    return min(most, max(least, tokens // TOKEN_ROUNDING * TOKEN_ROUNDING))


def tokens_per_mb(config: Any) -> int:
    """A :class:`~core_rl.config.schema.MicroBatchConfig`'s budget in tokens: its value, or for an
    ``auto`` no run resolved (an engine used on its own) :data:`CPU_TOKENS_PER_MB`."""
    value = config.max_tokens_per_mb
    return CPU_TOKENS_PER_MB if value == AUTO else int(value)


def safetensors_parameters(model_dir: str | Path) -> int | None:
    """The number of values in the ``*.safetensors`` files of ``model_dir`` (their headers only:
    no tensor is read); ``None`` when there is none or one does not parse."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for file in files:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in entry["shape"]:
                        count *= int(dim)
                    total += count
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def format_parameters(count: int) -> str:
    """``0.36B``, ``7.62B``, ``14.8B``, ``3.1M``: a parameter count for people (billions from 0.1B)."""
    if count >= 10**8:
        return f"{count / 1e9:.2f}B" if count < 10**10 else f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.1f}M"
