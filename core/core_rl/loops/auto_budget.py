"""Resolving ``<role>.micro_batch.max_tokens_per_mb: auto`` once, when a run starts.

Every train engine of the run is built first (:func:`core_rl.roles.build.build_engine` notes each in a
list of :class:`~core_rl.roles.built_engines.BuiltEngine`), so each knows its device and its weights are
in device memory. Then, for each role section whose budget is ``auto``, :func:`resolve_auto_budgets`

1. measures, on this rank, the free memory of the section's device and the gradients and optimiser
   state the trained roles on that device will still allocate;
2. gathers those figures from every rank, so all ranks decide from the same numbers (the least
   usable memory of any rank);
3. chooses the budget (:mod:`core_rl.loops.token_budget`: on a CPU 768 tokens, up to 2048 for a
   small model, what the free memory holds for this model's activations on a GPU), sets it in
   the section (the engines read
   it at their first micro-batch plan), records it as derived at the start
   (:class:`~core_rl.config.derived.Derived` with ``at_start``: ``<run>/config.yaml`` keeps
   ``auto`` with the value in a comment) and prints one line per section on rank 0::

       core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 768 (cpu, 0.13B parameters)
       core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 16384 (cuda:0, 71.2 GiB free, 0.36B parameters)

A ``ref`` without a section of its own shares the actor's, and so its budget. A number in the
configuration is never changed. A restarted or resumed run chooses again.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from core_rl.config.derived import Derived, record
from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.launch.ranks import rank_and_world, waiting_for
from core_rl.loops import token_budget as tb
from core_rl.roles.build import OPTIONAL_ROLES
from core_rl.roles.built_engines import BuiltEngine

GIB = 2**30
#: the key of the budget inside a role section
BUDGET_KEY = ("micro_batch", "max_tokens_per_mb")


@attrs.frozen
class Resolved:
    """What :func:`resolve_auto_budgets` chose for one section: its config key (``actor``), the
    budget, the line printed, and how it was derived (the comment in ``<run>/config.yaml``)."""

    key: str
    value: int
    line: str
    source: str


def section_key(cfg: RunConfig, section: ActorConfig, role: str) -> str:
    """The config key of ``section``: the role whose section it is (a ``ref`` built from the
    actor's section is the actor's), else ``role``."""
    for key in ("actor", *OPTIONAL_ROLES):
        if getattr(cfg, key) is section:
            return key
    return role


def is_auto(cfg: RunConfig, key: str, section: ActorConfig) -> bool:
    """Whether the section's budget is ``auto``: as configured, or chosen by an earlier start of this
    run in this process (an in-process restart builds a new trainer on the same configuration)."""
    derived = cfg.derived.get(f"{key}.{'.'.join(BUDGET_KEY)}")
    return section.micro_batch.max_tokens_per_mb == tb.AUTO or (derived is not None and derived.at_start)


def auto_sections(cfg: RunConfig, built: Sequence[BuiltEngine]) -> Iterator[tuple[str, list[BuiltEngine]]]:
    """``(key, engines)`` of each section whose budget is ``auto``, with the engines built from it,
    in the order they were built."""
    groups: dict[str, list[BuiltEngine]] = {}
    for b in built:
        key = section_key(cfg, b.section, b.role)
        if is_auto(cfg, key, b.section):
            groups.setdefault(key, []).append(b)
    yield from groups.items()


def compute_bytes(section: ActorConfig) -> int:
    """Bytes per activation value of the section's engine: the dtype its config's
    ``compute_dtype(section)`` names when it has that method (mixed precision), else the stored
    ``dtype``."""
    dtype = section.dtype
    config = section.engine.config
    chooser = getattr(config, "compute_dtype", None)
    if callable(chooser):
        dtype = chooser(section)
    return tb.DTYPE_BYTES.get(dtype, 4)


def model_config(model_path: str, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """The model's ``config.json`` as a mapping (``{}`` when it cannot be read): the local file,
    else through transformers (a hub id already in the cache; a configuration class it ships only
    with ``trust_remote_code``)."""
    path = Path(model_path) / "config.json"
    try:
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # the budget falls back to the CPU figure and says why
        return {}


def free_bytes(device: Any) -> int:
    """Memory the device can still give this process: the driver's free memory plus what torch's
    caching allocator holds unused."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def pending_bytes(built: Sequence[BuiltEngine], device: Any) -> int:
    """What the trained engines on ``device`` will allocate at their first optimiser step: what an
    engine with a ``pending_state_bytes()`` method says, else the estimate from its build
    (:func:`core_rl.loops.token_budget.pending_state_bytes`)."""
    total = 0
    for b in built:
        if b.trainable and b.device == device:
            own = getattr(b.engine, "pending_state_bytes", None)
            if callable(own):
                total += int(own())
                continue
            opt = b.section.optimizer
            total += tb.pending_state_bytes(
                b.weight_bytes, optimizer=opt.name, momentum=opt.momentum, lora=b.section.lora.enabled
            )
    return total


@attrs.frozen
class Facts:
    """One rank's figures for one section: its engines' ``device``, the bytes free there
    (:func:`free_bytes`; 0 off CUDA) and the bytes still ``pending`` (:func:`pending_bytes`)."""

    device: str
    free: int = 0
    pending: int = 0

    @property
    def usable(self) -> int:
        return self.free - self.pending


def local_facts(engines: Sequence[BuiltEngine], built: Sequence[BuiltEngine]) -> Facts:
    """This rank's :class:`Facts` for a section's ``engines`` (``built``: every engine of the run)."""
    device = engines[0].device
    if device.type != "cuda":
        return Facts(str(device))
    return Facts(str(device), free_bytes(device), pending_bytes(built, device))


def gathered(local: dict[str, Facts]) -> list[dict[str, Facts]]:
    """Every rank's :func:`local_facts` by section key, rank 0's first."""
    _rank, world = rank_and_world()
    if world == 1:
        return [local]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    with waiting_for("the other ranks' free device memory (the auto micro-batch budgets)"):
        dist.all_gather_object(out, local)
    return out


def activation_bytes(section: ActorConfig, shape: tb.ModelShape, engines: Sequence[BuiltEngine]) -> int:
    """:func:`core_rl.loops.token_budget.activation_bytes_per_token` for a section: its
    compute dtype, activation checkpointing, and a language-model head (fused or not) unless every
    engine built from it has a value or score head."""
    checkpointed = 0
    if section.gradient_checkpointing:
        checkpointed = tb.checkpointed_layers(shape.layers, section.gradient_checkpointing_every_n_layers)
    return tb.activation_bytes_per_token(
        shape,
        compute_bytes=compute_bytes(section),
        lm_head=any(b.head == "lm" for b in engines),
        checkpointed=checkpointed,
        offload=section.gradient_checkpointing_offload,
        fused_head=section.fused_head,
    )


def parameters_text(model_path: str, shape: tb.ModelShape) -> str:
    """``0.36B``: the parameters of the model's safetensors files, or ``~0.36B`` estimated from its shape."""
    count = tb.safetensors_parameters(model_path)
    if count is None:
        return f"~{tb.format_parameters(shape.estimated_parameters)}"
    return tb.format_parameters(count)


def choose(key: str, section: ActorConfig, engines: Sequence[BuiltEngine], facts: Sequence[Facts]) -> Resolved:
    """The budget of one section from every rank's facts (rank 0's first); see the module docstring."""
    setting = f"{key}.{'.'.join(BUDGET_KEY)}"
    device = facts[0].device
    shape = tb.ModelShape.from_config(model_config(section.model_path, trust_remote_code=section.trust_remote_code))
    if shape is None:
        cpu = tb.CPU_TOKENS_PER_MB
        why = f"the CPU figure: {section.model_path}/config.json names no layer count or hidden size"
        return Resolved(key, cpu, f"{setting}: auto -> {cpu} ({device}; {why})", f"{why} ({device})")
    per_token = activation_bytes(section, shape, engines)
    size = parameters_text(section.model_path, shape)
    if not device.startswith("cuda"):
        value = tb.cpu_token_budget(per_token)
        source = (
            f"{tb.CPU_ACTIVATION_BYTES / 2**20:.0f} MiB / {per_token / 2**10:.1f} KiB of activations per token, "
            f"a multiple of {tb.TOKEN_ROUNDING} in [{tb.CPU_TOKENS_PER_MB}, {tb.CPU_MAX_TOKENS_PER_MB}] "
            f"({device}, {size} parameters)"
        )
        return Resolved(key, value, f"{setting}: auto -> {value} ({device}, {size} parameters)", source)
    least = min(facts, key=lambda f: f.usable)
    value = tb.gpu_token_budget(least.usable, per_token)
    of_ranks = f" (least of {len(facts)} ranks)" if len(facts) > 1 else ""
    group = int(getattr(section.engine.config, "sequence_parallel_size", 1) or 1)
    # under sequence parallelism the budget counts one rank's share of the group's micro-batch
    split = f"; a group of {group} ranks splits {value * group} tokens" if group > 1 else ""
    line = f"{setting}: auto -> {value} ({device}, {least.free / GIB:.1f} GiB free{of_ranks}, {size} parameters{split})"
    source = (
        f"{tb.ACTIVATION_SHARE} x (free {least.free / GIB:.2f} GiB - gradients and optimizer state "
        f"{least.pending / GIB:.2f} GiB) / {per_token / 2**20:.2f} MiB of activations per token, a multiple of "
        f"{tb.TOKEN_ROUNDING} in [{tb.GPU_MIN_TOKENS_PER_MB}, {tb.GPU_MAX_TOKENS_PER_MB}] ({device}, {size} parameters)"
    )
    return Resolved(key, value, line, source)


def resolve_auto_budgets(cfg: RunConfig, built: Sequence[BuiltEngine], *, out: TextIO | None = None) -> list[Resolved]:
    """Choose, set and record the budget of every section of ``cfg`` whose budget is ``auto``, from
    the engines ``built`` (see the module docstring); rank 0 prints each to ``out`` (stderr).
    Collective: every rank calls it after building the same engines."""
    sections = dict(auto_sections(cfg, built))
    if not sections:
        return []
    local = {key: local_facts(engines, built) for key, engines in sections.items()}
    ranks = gathered(local)
    chosen = []
    for key, engines in sections.items():
        section = engines[0].section
        resolved = choose(key, section, engines, [facts[key] for facts in ranks])
        section.micro_batch.max_tokens_per_mb = resolved.value
        record(cfg, Derived((key, *BUDGET_KEY), resolved.value, tb.AUTO, resolved.source, at_start=True))
        chosen.append(resolved)
    if rank_and_world()[0] == 0:
        stream = out if out is not None else sys.stderr
        for resolved in chosen:
            print(f"core-rl: {resolved.line}", file=stream, flush=True)
    return chosen
