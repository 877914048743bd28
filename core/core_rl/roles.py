"""Model roles: the models one run holds besides the rollout engine, each built by a train-engine
plugin from its own configuration section.

=========  ============  =========  ==========================================================
role       section       trained    built when
=========  ============  =========  ==========================================================
actor      ``actor:``    yes        always (the policy)
ref        ``ref:``      no         the loss or advantage needs ``ref_logprobs``; without a
                                    ``ref:`` section it is the actor's model, frozen
critic     ``critic:``   yes        a ``critic:`` section is given (value head, ``head="value"``)
teacher    ``teacher:``  no         a ``teacher:`` section is given (on-policy distillation)
=========  ============  =========  ==========================================================

Every section has the keys of ``actor`` (model path, engine, dtype, optimiser, micro-batches) and is
validated the same way; the critic adds its value-loss keys
(:class:`~core_rl.config.schema.CriticConfig`), the teacher its coefficients
(:class:`~core_rl.config.schema.TeacherConfig`). A frozen reward model stays the ``reward_model``
reward plugin's own section (it scores text, not token ids of this run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.errors import ConfigError
from core_rl.kinds import TRAIN_ENGINE

if TYPE_CHECKING:
    from core_rl.interfaces import TrainEngine
    from core_rl.plugins import PluginHost
    from core_rl.registry import RegistryEntry

#: the optional role sections of a run, in the order they are built
OPTIONAL_ROLES = ("ref", "critic", "teacher")


def role_sections(cfg: RunConfig) -> Iterator[tuple[str, ActorConfig]]:
    """``(role, section)`` of every optional role section the configuration sets."""
    for role in OPTIONAL_ROLES:
        section = getattr(cfg, role)
        if section is not None:
            yield role, section


def engine_heads(entry: RegistryEntry) -> tuple[str, ...]:
    """The heads (:data:`core_rl.interfaces.HEADS`) a train engine builds: the ``heads`` attribute of
    its config class, ``("lm",)`` without one."""
    return tuple(getattr(entry.config_cls, "heads", ("lm",)))


def role_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """Configuration problems of the role sections: a required ``model_path``, and a critic on an
    engine that cannot build a value model (named, with its distribution)."""
    problems = []
    for role, section in role_sections(cfg):
        if not section.model_path:
            problems.append(f"{role}.model_path: required; the path of a Hugging Face model directory")
    if cfg.critic is not None:
        entry = host.registries[TRAIN_ENGINE.key].get(cfg.critic.engine.name)
        if entry is not None and "value" not in engine_heads(entry):
            problems.append(missing_head_problem(entry, "value", "critic.engine.name", "a value model"))
    return problems


def missing_head_problem(entry: RegistryEntry, head: str, key: str, model: str) -> str:
    """The message for a train engine (``entry``, selected at config ``key``) whose config class
    lists no ``head``, which ``model`` (e.g. "a value model") needs: names the engine and its
    distribution and what to do."""
    return (
        f"{key}: train engine {entry.name!r} (distribution {entry.distribution}) cannot build {model} "
        f"(its config class lists no {head!r} head); use an engine that does, e.g. fsdp"
    )


def build_engine(host: PluginHost, section: ActorConfig, *, trainable: bool, head: str = "lm") -> TrainEngine:
    """The train engine of one role section (``head="value"`` is passed only for a value model, so
    engines without value heads keep their factory signature)."""
    entry = host.get(TRAIN_ENGINE, section.engine.name)
    kwargs: dict[str, Any] = {"trainable": trainable}
    if head != "lm":
        kwargs["head"] = head
    return entry.factory(section, section.engine.config, **kwargs)


@attrs.define
class Roles:
    """The models of a run besides the actor (``None`` where the run has no such role)."""

    ref: TrainEngine | None = None
    critic: TrainEngine | None = None
    teacher: TrainEngine | None = None

    def engines(self) -> list[TrainEngine]:
        return [e for e in (self.ref, self.critic, self.teacher) if e is not None]

    def close(self) -> None:
        for engine in self.engines():
            engine.close()
        self.ref = self.critic = self.teacher = None


def build_roles(cfg: RunConfig, host: PluginHost, *, needs_reference: bool, needs_values: bool) -> Roles:
    """Build the reference (when ``needs_reference``: from ``ref:`` or the actor's section, frozen),
    the critic and the teacher (from their sections). A critic the algorithm does not use, or an
    algorithm needing values without a critic, is a :class:`~core_rl.errors.ConfigError`."""
    if needs_values and cfg.critic is None:
        raise ConfigError(
            [
                f"critic: algorithm.advantage {cfg.algorithm.advantage.name if cfg.algorithm.advantage else ''!r} "
                "needs a value model; add a critic: section (e.g. critic: {model_path: ...})"
            ]
        )
    if cfg.critic is not None and not needs_values:
        raise ConfigError(
            ["critic: no component of the algorithm uses values (e.g. algorithm.advantage: {name: gae}); remove it"]
        )
    roles = Roles()
    try:
        if needs_reference:
            roles.ref = build_engine(host, cfg.ref or cfg.actor, trainable=False)
        if cfg.critic is not None:
            roles.critic = build_engine(host, cfg.critic, trainable=True, head="value")
        if cfg.teacher is not None:
            roles.teacher = build_engine(host, cfg.teacher, trainable=False)
    except BaseException:
        roles.close()
        raise
    return roles
