"""The bench card of ``benchmarks/gpu_grpo.py``: one table per shape of where a GRPO step's time goes
and how much of the device it uses.

Per side (core-rl, and TRL where it ran), from the medians of :func:`trl_grpo.summarise`:

- ``s/step`` and its split: ``generate`` (the rollout engine's sampling), ``train`` (the update:
  forward, backward and optimizer step over the batch), ``sync`` (weight sync into the rollout
  engine) and ``other`` (the rest of the step: rewards, batching, and log-prob recomputation, which
  is zero in this workload: one optimizer step per generation batch reuses the sampled log-probs);
- ``gen tok/s`` = generated tokens per step / ``generate`` seconds, the generated tokens per step
  being ``prompts * samples * response tokens`` (``min_new_tokens = max_new_tokens``: every sample
  has exactly that many);
- ``train tok/s`` = ``D`` / ``train`` seconds, ``D`` the tokens the update runs over per step
  (prompt and response tokens of every sample, no padding);
- ``TFLOP/step`` = :func:`train_flops`: ``6 * N * D + 12 * L * H * S * D`` (below);
- ``MFU`` = ``TFLOP/step / train seconds / peak``, the peak being the device's dense bf16 FLOP/s
  (:func:`peak_tflops`), ``unknown`` where the device is not in :data:`PEAK_TFLOPS` (the CPU) and
  ``--peak-tflops`` does not give it. It is the update's MFU only: generation is bound by memory
  bandwidth (a token per sample per forward), so its figure is ``gen tok/s``, not a FLOP ratio;
- ``peak GiB``: the peak device memory (``torch.cuda.max_memory_allocated``; resident set size on
  the CPU).

The FLOP count (PaLM's, Chowdhery et al. 2022, appendix B) of the update over ``D`` tokens of
sequences of mean length ``S`` of a model with ``N`` parameters, ``L`` layers and hidden size ``H``:

- ``6 * N * D``: every parameter is in one matrix product per token, ``2 * N`` FLOPs forward
  (a multiply and an add), twice that backward (the gradients of the activations and of the
  weights). Tied embeddings count once: the lookup is free and the LM head is the product. Biases
  and norms are in ``N`` too (a rounding error: 0.02% of the 0.36B model);
- ``12 * L * H * S * D``: attention's two products per layer, ``Q K^T`` and ``softmax(.) V``, each
  ``2 * S * H`` FLOPs per token forward, so ``4 * L * H * S`` forward and three times that with the
  backward; over the full ``S x S`` square as PaLM counts it (a causal kernel skips about half),
  so that figures compare with published MFUs.
"""

from __future__ import annotations

from dataclasses import dataclass

#: peak dense bf16 tensor-core FLOP/s, in TFLOP/s, by a fragment of ``torch.cuda.get_device_name``
#: (the first fragment the name contains wins: the PCIe and NVL parts before their SXM siblings),
#: from NVIDIA's data sheets (their "with sparsity" figures halved)
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM
    ("A100", 312.0),
)


def peak_tflops(device: str, override: float | None = None) -> float | None:
    """The device's peak dense bf16 TFLOP/s: ``override`` (``--peak-tflops``) if given, else the
    first entry of :data:`PEAK_TFLOPS` whose fragment ``device`` contains, else ``None`` (unknown)."""
    if override is not None:
        return override
    for fragment, tflops in PEAK_TFLOPS:
        if fragment.lower() in device.lower():
            return tflops
    return None


def train_flops(params: int, layers: int, hidden: int, seq_len: float, tokens: int) -> float:
    """FLOPs of one update (forward and backward) over ``tokens`` tokens of sequences of mean length
    ``seq_len``: ``6 * params * tokens + 12 * layers * hidden * seq_len * tokens``."""
    return 6.0 * params * tokens + 12.0 * layers * hidden * seq_len * tokens


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOP utilisation: ``flops / seconds / (peak * 1e12)`` (``peak`` in TFLOP/s), or
    ``None`` when the peak is unknown or no time was measured."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12)


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs of a shape: parameters, layers, hidden size, and per step the
    samples, the response tokens of each and the prompt tokens of all (their sum)."""

    params: int
    layers: int
    hidden: int
    samples: int  # prompts * completions per prompt
    response_tokens: int  # per sample
    prompt_tokens: int  # per step, summed over the samples (a prompt counts once per completion)

    @property
    def generated(self) -> int:
        """Generated tokens per step: ``samples * response_tokens``."""
        return self.samples * self.response_tokens

    @property
    def trained(self) -> int:
        """Tokens the update runs over per step: ``prompt_tokens + samples * response_tokens``."""
        return self.prompt_tokens + self.generated

    @property
    def seq_len(self) -> float:
        """Mean sequence length: ``trained / samples``."""
        return self.trained / self.samples


@dataclass(frozen=True)
class Card:
    """One side's figures on one shape (times in seconds per step, medians)."""

    step: float
    generate: float
    train: float
    sync: float
    other: float
    gen_tps: float
    train_tps: float
    tflop: float  # of the update, per step
    mfu: float | None
    peak_gib: float


def card(summary: dict, shape: Shape, peak: float | None) -> Card:
    """The card of one side from its summary (``gpu_grpo.summary``: ``step``, ``split`` with the
    phases of ``trl_grpo.PHASES``, ``peak_gib``); log-prob recomputation counts as ``other``."""
    split = summary["split"]
    flops = train_flops(shape.params, shape.layers, shape.hidden, shape.seq_len, shape.trained)
    train = split["train"]
    return Card(
        step=summary["step"],
        generate=split["generate"],
        train=train,
        sync=split["weight_sync"],
        other=split["other"] + split["logprobs"],
        gen_tps=shape.generated / split["generate"] if split["generate"] > 0 else 0.0,
        train_tps=shape.trained / train if train > 0 else 0.0,
        tflop=flops / 1e12,
        mfu=mfu(flops, train, peak),
        peak_gib=summary["peak_gib"],
    )


#: the card's columns: (heading, width, format of a value)
COLUMNS: tuple[tuple[str, int], ...] = (
    ("side", 9),
    ("s/step", 8),
    ("generate", 9),
    ("train", 8),
    ("sync", 7),
    ("other", 7),
    ("gen tok/s", 11),
    ("train tok/s", 12),
    ("TFLOP/step", 11),
    ("MFU", 8),
    ("peak GiB", 9),
)


def format_mfu(value: float | None) -> str:
    """``"12.3%"``, or ``"unknown"`` without a peak."""
    return "unknown" if value is None else f"{100 * value:.1f}%"


def card_table(label: str, device: str, peak: float | None, shape: Shape, cards: dict[str, Card]) -> str:
    """The card of one shape as text: a heading with the FLOP count's inputs, then a row per side."""
    peak_text = f"{peak:g} TFLOP/s" if peak is not None else "unknown (--peak-tflops sets it)"
    lines = [
        f"bench card: {label} on {device}",
        f"  FLOP/step = 6*N*D + 12*L*H*S*D with N={shape.params:,} parameters, L={shape.layers}, H={shape.hidden}, "
        f"D={shape.trained:,} tokens ({shape.prompt_tokens:,} prompt + {shape.generated:,} generated), "
        f"S={shape.seq_len:.1f}; MFU = FLOP/step / train s / peak, peak dense bf16 {peak_text}",
    ]
    head = "".join(f"{name:<{width}}" if i == 0 else f"{name:>{width}}" for i, (name, width) in enumerate(COLUMNS))
    lines += [head, "-" * len(head)]
    for side, c in cards.items():
        values = (
            side,
            f"{c.step:.3f}",
            f"{c.generate:.3f}",
            f"{c.train:.3f}",
            f"{c.sync:.3f}",
            f"{c.other:.3f}",
            f"{c.gen_tps:,.0f}",
            f"{c.train_tps:,.0f}",
            f"{c.tflop:.3g}",
            format_mfu(c.mfu),
            f"{c.peak_gib:.2f}",
        )
        lines.append(
            "".join(
                f"{v:<{width}}" if i == 0 else f"{v:>{width}}" for i, (v, (_, width)) in enumerate(zip(values, COLUMNS))
            )
        )
    return "\n".join(lines)
