"""What ``teacher.loss: topk_forward_kl`` asks of the run (:mod:`core_rl.loops.rl.distill`): the
teacher's engine computes its top-k ids and log-probs per token
(:meth:`~core_rl.interfaces.TrainEngine.compute_topk_logprobs`) and the actor's engine the
policy's log-probs of those ids in its training forward (:data:`core_rl.interfaces.LOGPROBS_AT`).
Engines that can say so with ``topk_logprobs = True`` on their config class; both need the whole
logits on one rank, so neither may use ``fused_head`` or sequence parallelism. Reads the teacher's
``config.json`` (no weights) to bound ``top_k`` by its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from core_rl.plugins.kinds import TRAIN_ENGINE

if TYPE_CHECKING:
    from core_rl.config.schema import ActorConfig, RunConfig
    from core_rl.plugins.host import PluginHost

TOPK_LOSS = "topk_forward_kl"


def topk_distill_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """One message per setting that ``teacher.loss: topk_forward_kl`` cannot run with (module
    docstring); none for another loss or without a teacher."""
    teacher = cfg.teacher
    if teacher is None or teacher.loss != TOPK_LOSS:
        return []
    problems = []
    for role, section in (("actor", cfg.actor), ("teacher", teacher)):
        problems += _role_problems(role, section, host)
    sizes = {
        role: model_vocab_size(path)
        for role, path in (("teacher", teacher.model_path), ("actor", cfg.actor.model_path))
    }
    known = {role: size for role, size in sizes.items() if size is not None}
    bound = min(known.values(), default=None)
    if bound is not None and teacher.top_k > bound:
        whose = " and ".join(f"the {role}'s" for role, size in known.items() if size == bound)
        problems.append(
            f"teacher.top_k: {teacher.top_k}, more than the {bound} tokens of {whose} vocabulary (the top k are "
            f"taken among the tokens both models have); set it to at most {bound}"
        )
    return problems


def _role_problems(role: str, section: ActorConfig, host: PluginHost) -> list[str]:
    why = f"teacher.loss: {TOPK_LOSS} needs the {role}'s whole logits"
    entry = host.registries[TRAIN_ENGINE.key].get(section.engine.name)
    if entry is not None and not getattr(entry.config_cls, "topk_logprobs", False):
        return [
            f"{role}.engine.name: train engine {entry.name!r} (distribution {entry.distribution}) does not compute "
            f"log-probs of given token ids (its config class does not set topk_logprobs = True), which teacher.loss: "
            f"{TOPK_LOSS} needs; use fsdp or deepspeed, or set teacher.loss: reverse_kl"
        ]
    problems = []
    if section.fused_head:
        problems.append(f"{role}.fused_head: {why}, which the fused head never forms; set it to false")
    size = getattr(section.engine.config, "sequence_parallel_size", 1)
    if isinstance(size, int) and size > 1:
        problems.append(
            f"{role}.engine.sequence_parallel_size: {size}; {why} on each rank, which sequence parallelism splits; "
            "set it to 1"
        )
    return problems


def model_vocab_size(model_path: str) -> int | None:
    """``vocab_size`` of a local model directory's ``config.json`` (its text config's too), ``None``
    where it cannot be read (a hub id: the build says so). A teacher's top k is taken among the
    actor's first ``vocab_size`` tokens (:class:`core_rl.loops.rl.update.PolicyUpdate`): a larger
    model of the family may pad its embedding past the actor's."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        if isinstance(part.get("vocab_size"), int):
            return int(part["vocab_size"])
    return None
