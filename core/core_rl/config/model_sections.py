"""The keys every model role section (``actor``, ``ref``, ``critic``, ``teacher``,
``reward_model``) shares besides its model and engine: the optimiser, the learning-rate schedule,
the micro-batches, LoRA and mixture-of-experts training. Re-exported by :mod:`core_rl.config.schema`."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from core_rl.config.validators import (
    MAX_COUNT,
    MAX_STEPS,
    MAX_TOKENS,
    FieldValueError,
    auto_or,
    each,
    in_range,
    non_negative,
    one_of,
    positive,
)

#: the value of ``max_tokens_per_mb`` that asks for a budget chosen at the run's start
#: (:mod:`core_rl.loops.token_budget`)
AUTO = "auto"
#: the type of ``max_tokens_per_mb``: a number of tokens or ``auto`` (structured by
#: :mod:`core_rl.config.converter`)
TokenBudget = int | Literal["auto"]


#: the optimizers ``OptimizerConfig.name`` selects (:func:`core_rl_train_kit.optim.build_optimizer`)
OPTIMIZERS = ("adamw", "sgd", "adafactor", "muon", "class")


@attrs.define
class OptimizerConfig:
    """``name``: ``adamw``, ``sgd``, ``adafactor``, ``muon`` or ``class``, each built over the
    parameter groups of ``no_decay`` at ``lr`` with ``weight_decay``:

    - ``adamw``: ``torch.optim.AdamW`` with ``betas``, ``eps`` (decoupled weight decay).
      ``implementation`` picks its kernel: torch's ``fused`` one (one pass over all parameters),
      ``foreach`` or ``for_loop``; ``auto`` is ``fused`` when every parameter is a plain CPU/CUDA
      floating tensor (not a sharded DTensor), else torch's default. The kernels compute the same
      update up to float rounding.
    - ``sgd``: ``torch.optim.SGD`` with ``momentum`` (weight decay added to the gradient, L2).
    - ``adafactor``: ``torch.optim.Adafactor`` (factored second moments: a row and a column
      vector per matrix instead of a full tensor; decoupled weight decay; its step is
      ``lr``-scaled by the parameter's RMS, so ``lr`` around 1e-2 is its default), with ``kwargs``
      passed to it (``beta2_decay``, ``eps``, ``d``, ``maximize``, ``foreach``).
    - ``muon``: ``torch.optim.Muon`` (momentum ``muon_momentum``, default 0.95, Nesterov; the
      update orthogonalised by Newton-Schulz iterations and scaled by ``sqrt(max(1, rows/cols))``)
      at ``muon_lr`` (default: ``lr``) for the hidden weight matrices: every two-dimensional
      trainable parameter but the embeddings and the output head; AdamW with ``betas``, ``eps``,
      ``implementation`` at ``lr`` for those and for every parameter of fewer dimensions (biases,
      norm scales). The schedule scales both rates alike (``muon_lr / lr`` stays fixed). Muon
      needs whole matrices on every rank: engines that shard or flatten parameters refuse it
      (fsdp with several processes or sharding one, deepspeed, megatron on a GPU or with
      tensor parallelism), and so does LoRA.
    - ``class``: the optimizer class ``class_path`` names (``package.module:ClassName`` or
      ``path/to/file.py:ClassName``, a ``torch.optim.Optimizer`` subclass), called as
      ``Class(groups, lr=lr, weight_decay=weight_decay, **kwargs)``; ``weight_decay`` is passed
      only when the constructor takes it (else it must be 0), and ``params``, ``lr`` and
      ``weight_decay`` cannot be ``kwargs``. Loaded and checked when the configuration loads.

    A key that does not apply to ``name`` (``betas`` with ``adafactor``, ``momentum`` with
    ``adamw``, ``class_path`` without ``class``, ...) is refused when set to anything but its
    default.

    ``no_decay``: which parameters ``weight_decay`` spares. ``biases_and_norms`` (the default):
    every parameter with fewer than two dimensions (biases, RMSNorm/LayerNorm scales), the rule of
    Hugging Face's Trainer (so TRL), OpenRLHF and Megatron; ``none``: every parameter is decayed
    (verl). It matters only when ``weight_decay > 0`` (then the optimizer has two parameter groups).
    A resumed run decays as its own configuration says, whatever the checkpoint was saved with."""

    name: str = attrs.field(default="adamw", validator=one_of(OPTIMIZERS))
    lr: float = attrs.field(default=1e-5, validator=positive(10.0))
    weight_decay: float = attrs.field(default=0.0, validator=non_negative())
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), validator=each(in_range(0.0, 1.0, high_open=True)))
    eps: float = attrs.field(default=1e-8, validator=positive(1.0))
    momentum: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0, high_open=True))
    implementation: str = attrs.field(default="auto", validator=one_of(("auto", "fused", "foreach", "for_loop")))
    no_decay: str = attrs.field(default="biases_and_norms", validator=one_of(("biases_and_norms", "none")))
    muon_lr: float | None = attrs.field(default=None, validator=positive(10.0))
    muon_momentum: float = attrs.field(default=0.95, validator=in_range(0.0, 1.0, high_open=True))
    class_path: str | None = None
    kwargs: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class SchedulerConfig:
    """Learning-rate schedule: linear warmup over ``warmup_steps`` (or ``warmup_ratio`` of the total
    steps when ``warmup_steps`` is 0), then ``constant``, ``linear`` or ``cosine`` decay to
    ``min_lr_ratio * lr`` at step ``total_steps`` (0: ``trainer.total_steps`` times the optimiser
    steps per RL step). Steps here are optimiser steps. Both 0 defaults are filled in on load and
    stay derived in the recorded configuration (:mod:`core_rl.config.derived`).

    ``wsd`` (warmup-stable-decay, as MiniCPM's and Megatron's): the learning rate stays at ``lr``
    after the warmup and decays only over the last ``decay_ratio`` of ``total_steps`` (at least one
    step), in the ``decay_style`` ``linear``, ``cosine`` or ``1-sqrt``; both keys apply to ``wsd`` alone."""

    name: str = attrs.field(default="constant", validator=one_of(("constant", "linear", "cosine", "wsd")))
    warmup_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    warmup_ratio: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    min_lr_ratio: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    total_steps: int = attrs.field(default=0, validator=in_range(0, MAX_STEPS))
    decay_ratio: float = attrs.field(default=0.1, validator=in_range(0.0, 1.0, low_open=True))
    decay_style: str = attrs.field(default="linear", validator=one_of(("linear", "cosine", "1-sqrt")))

    def __attrs_post_init__(self) -> None:
        if self.name != "wsd":
            for key, default in (("decay_ratio", 0.1), ("decay_style", "linear")):
                if getattr(self, key) != default:
                    raise FieldValueError(key, getattr(self, key), f"applies only to name: wsd (not {self.name})")

    @property
    def wsd_decay_steps(self) -> int:
        """The steps of a ``wsd`` schedule's decay: ``max(1, floor(decay_ratio * total_steps))``."""
        return max(1, int(self.decay_ratio * self.total_steps))


@attrs.define
class MicroBatchConfig:
    """How a rank's rows become micro-batches (:mod:`core_rl_train_kit.packing`) and how rows
    are shared out over data-parallel ranks.

    - ``max_tokens_per_mb``: token budget of one micro-batch: rows x padded width in the padded
      layout, the sum of the rows' lengths in the packed one (a single longer row runs alone);
      ``min_num_mb``: at least this many micro-batches. The budget bounds the activations kept
      for backward (they grow with the tokens of one micro-batch, not of the batch). ``auto`` (the
      default) is chosen once at the run's start, where the role's engine knows its device, and
      printed (``core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 16384 (cuda:0, ...)``):
      on a CPU the tokens whose activations fill 256 MiB, between 768 (SmolLM2-135M and larger
      models: their matrix products already run near full speed there) and 2048 (small models, whose
      shorter micro-batches show each one's fixed costs); on a GPU what the free device memory
      holds for this model's activations,
      between 1024 and 16384 (the formula: :mod:`core_rl.loops.token_budget`; on one H100
      a 0.36B model's update took 5.74 s with 768 and 0.23 s with 16640). A number always wins.
      ``<run>/config.yaml`` keeps ``auto`` with the chosen value in a comment.
    - ``packing_algorithm``: ``ffd`` (first-fit-decreasing: few micro-batches, rows of similar
      length together, then evened out: the budget is lowered as far as no more micro-batches are
      needed, so 1.08 budgets of rows make two halves, not a full one and a small one), ``kk``
      (Karmarkar-Karp: micro-batches of nearly equal token load) or ``greedy`` (consecutive rows
      in batch order).
    - ``layout``: ``padded`` ([rows, width] with an attention mask), ``packed`` (padding-free: one
      row per micro-batch with ``position_ids`` restarting at 0, ``cu_seqlens`` for flash-attn),
      ``shared`` or ``auto``. ``shared`` (:mod:`core_rl_train_kit.shared_prefix`): rows that
      begin with the same prompt (a GRPO group's samples: the same tokens before the first
      ``response_mask`` 1) are planned into the same micro-batch and run as one row, the prompt
      once and each row's response after it, through a 4D attention mask and explicit
      ``position_ids`` (SDPA or eager attention; not with sequence parallelism, sliding-window or
      chunked attention); rows without a shared prompt, top-k log-probs and log-probs of given
      ids run padded. SmolLM2-135M on a CPU, 8 prompts x 4 samples of 32 tokens after 40-57-token
      chat prompts: 1460 tokens run instead of 2643, the fsdp engine's ``train_step`` took 23.5
      CPU seconds instead of 41.9 (``benchmarks/shared_prefix.py``). The micro-batch budget then
      counts stream rows x their longest stream. Rows share within a data-parallel rank (the
      rank assignment does not keep a prompt's samples together). ``auto`` (the default):
      packed with a flash-attn kernel; otherwise shared for the plans where it saves at least 20%
      of the work (tokens, and the attention's query x key pairs), padded for the others (faster
      on CPU/SDPA than packed, see docs/benchmarks.md). The loss does not depend on the layout.
    - ``rank_assignment``: ``balanced`` gives each data-parallel rank nearly the same number of
      tokens (Karmarkar-Karp over row lengths); ``strided`` gives rank ``r`` rows ``r, r+W, ...``.
    """

    max_tokens_per_mb: int | Literal["auto"] = attrs.field(default=AUTO, validator=auto_or(in_range(1, MAX_TOKENS)))
    min_num_mb: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))
    packing_algorithm: str = attrs.field(default="ffd", validator=one_of(("ffd", "kk", "greedy")))
    layout: str = attrs.field(default="auto", validator=one_of(("auto", "padded", "packed", "shared")))
    rank_assignment: str = attrs.field(default="balanced", validator=one_of(("balanced", "strided")))


@attrs.define
class LoraConfig:
    """Low-rank adapters (LoRA, through peft) on the trained model: ``rank`` 0 trains every weight
    (no adapters); ``rank > 0`` freezes the base model and trains only the adapters ``B @ A``
    (``rank`` columns), scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``,
    rank-stabilised LoRA, whose updates keep their size as the rank grows), with ``dropout`` on
    their input.
    ``target_modules``: module names (or suffixes) to adapt, or ``["all-linear"]`` for every
    linear layer except the output head. Exports and weight syncs carry merged weights (plain
    Hugging Face names); the adapter alone is exported too (peft's ``save_pretrained`` format).
    A frozen reference model built from the same section is the base model, without adapters."""

    rank: int = attrs.field(default=0, validator=in_range(0, 65536))
    alpha: float = attrs.field(default=16.0, validator=positive(1e6))
    dropout: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0, high_open=True))
    target_modules: list[str] = attrs.field(factory=lambda: ["all-linear"])
    use_rslora: bool = False

    @property
    def enabled(self) -> bool:
        return self.rank > 0


#: ``actor.moe.routing_replay`` values
ROUTING_REPLAY_MODES = ("none", "rollout", "first_forward")
#: ``actor.moe.router_dtype`` values
ROUTER_DTYPES = ("auto", "float32")


@attrs.define
class MoEConfig:
    """The ``actor.moe`` section: mixture-of-experts training and routing replay (:mod:`core_rl_train_kit.moe`).
    Options for a mixture-of-experts actor (ignored by a dense model, except ``routing_replay``,
    which needs an MoE model's routers).

    - ``routing_replay``: which experts the training forwards (log-probs, reference, update) route
      each token to:

      - ``none``: the training model's own routers choose (the default);
      - ``rollout`` (R3): the experts the rollout engine chose when it generated the sample
        (``Sample.routed_experts``; the rollout engine is asked to return them, and must be able
        to: ``hf``); a token without a rollout route (the last response token, a token a multi-turn
        workflow inserted without running the model) is routed by the training router;
      - ``first_forward`` (R2): the experts of the step's first training forward over the batch
        (the log-prob forward where the algorithm recomputes log-probs, else the first update
        forward), replayed in every later forward of the step (the other micro-steps, PPO epochs).

      Replayed experts take their weights from the training router's own softmax at those experts,
      so the router still trains.
    - ``router_dtype``: ``float32`` computes the routers' logits in float32 whatever the model's
      dtype or autocast (AReaL's ``moe_router_dtype``); ``auto`` leaves them in the model's precision.
    - ``router_aux_loss_coef``: weight of the routers' load-balancing loss (Switch Transformer's
      ``E * sum_e f_e * P_e`` per layer, Hugging Face's ``load_balancing_loss_func``) added to the
      policy loss; ``null`` takes the model config's ``router_aux_loss_coef`` (0 turns it off).
    - ``load_metrics``: log per-expert load each step (``moe/tokens_per_expert/layer<l>/expert<e>``
      fractions and ``moe/imbalance`` = max/mean tokens per expert, mean over layers).
    """

    routing_replay: str = attrs.field(default="none", validator=one_of(ROUTING_REPLAY_MODES))
    router_dtype: str = attrs.field(default="auto", validator=one_of(ROUTER_DTYPES))
    router_aux_loss_coef: float | None = attrs.field(default=None, validator=non_negative())
    load_metrics: bool = True

    @property
    def replays(self) -> bool:
        """Whether the training forwards replay routes."""
        return self.routing_replay != "none"
