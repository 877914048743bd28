"""Model roles: the models one run holds besides the rollout engine, each built by a train-engine
plugin from its own configuration section.

============  =================  =======  ====================================================
role          section            trained  built when
============  =================  =======  ====================================================
actor         ``actor:``         yes      always (the policy)
ref           ``ref:``           no       the loss or advantage needs ``ref_logprobs``; without
                                          a ``ref:`` section it is the actor's model, frozen
critic        ``critic:``        yes      a ``critic:`` section is given (value head,
                                          ``head="value"``)
teacher       ``teacher:``       no       a ``teacher:`` section is given (on-policy
                                          distillation)
reward_model  ``reward_model:``  no       a ``reward_model:`` section is given (a scorer,
                                          ``head="score"``, :mod:`core_rl.loops.rl.reward_model`)
============  =================  =======  ====================================================

Every section has the keys of ``actor`` (model path, engine, dtype, optimiser, micro-batches) and is
validated the same way; the critic adds its value-loss keys
(:class:`~core_rl.config.schema.CriticConfig`), the teacher its coefficients
(:class:`~core_rl.config.schema.TeacherConfig`), the reward model its coefficient and where the
score is read (:class:`~core_rl.config.schema.RewardModelRoleConfig`). The teacher and the reward
model read the policy's token ids, as do a separate ref and critic, so every role must share its
tokenizer (:func:`shared_tokenizer_problems`, in preflight). The ``reward_model`` *reward* plugin is
the other way to serve a reward model: on the main rank, on decoded text, with any tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.overrides import first_line
from core_rl.config.schema import ActorConfig, RunConfig
from core_rl.config.teacher_checks import topk_distill_problems
from core_rl.errors import ConfigError
from core_rl.plugins.components import build_component
from core_rl.plugins.kinds import TRAIN_ENGINE
from core_rl.roles.built_engines import BuiltEngine, cuda_allocated, weight_bytes_since

if TYPE_CHECKING:
    from core_rl.interfaces import TrainEngine
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.registry import RegistryEntry

#: the optional role sections of a run, in the order they are built
OPTIONAL_ROLES = ("ref", "critic", "teacher", "reward_model")


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
    """Configuration problems of the role sections: a required ``model_path``, a critic on an
    engine that cannot build a value model (named, with its distribution), and ``fused_head`` where
    it cannot apply (:func:`fused_head_problems`), and what a top-k teacher loss needs
    (:func:`~core_rl.config.teacher_checks.topk_distill_problems`)."""
    problems = []
    for role, section in role_sections(cfg):
        if not section.model_path:
            problems.append(f"{role}.model_path: required; the path of a Hugging Face model directory")
    problems += fused_head_problems(cfg, host)
    problems += topk_distill_problems(cfg, host)
    if cfg.critic is not None:
        entry = host.registries[TRAIN_ENGINE.key].get(cfg.critic.engine.name)
        if entry is not None and "value" not in engine_heads(entry):
            problems.append(missing_head_problem(entry, "value", "critic.engine.name", "a value model"))
    if cfg.reward_model is not None:
        entry = host.registries[TRAIN_ENGINE.key].get(cfg.reward_model.engine.name)
        if entry is not None and "score" not in engine_heads(entry):
            problems.append(missing_head_problem(entry, "score", "reward_model.engine.name", "a reward model"))
        problems.extend(_reward_model_sampling_problems(cfg))
    return problems


def _reward_model_sampling_problems(cfg: RunConfig) -> list[str]:
    """Sample filters and dynamic sampling run on the main rank before the reward model scores (on
    every rank, after the batch is sent): they would judge samples without their reward-model score."""
    problems = []
    where = "run on the main rank before the reward_model: role scores the samples, so they cannot see its scores"
    if cfg.algorithm.filters:
        names = ", ".join(repr(f.name) for f in cfg.algorithm.filters)
        problems.append(
            f"algorithm.filters: the sample filters ({names}) {where}; remove them (algorithm.filters=[]) or "
            "serve the reward model as a reward (reward: {name: reward_model, ...}), which scores before the filters"
        )
    if cfg.algorithm.max_num_gen_batches > 1:
        problems.append(
            f"algorithm.max_num_gen_batches: dynamic sampling ({cfg.algorithm.max_num_gen_batches}) and its filters "
            f"{where}; set algorithm.max_num_gen_batches=1 with a reward_model: section"
        )
    return problems


def reward_model_problems(cfg: RunConfig, actor_tokenizer: Any = None) -> list[str]:
    """Problems of a ``reward_model:`` section's model directory that would make its scores wrong
    without an error: a model with no score head (its head would start at zero: every score 0), and
    a tokenizer other than the actor's (it would read the policy's token ids as other tokens; see
    :func:`shared_tokenizer_problems`). Reads ``config.json`` and the tokenizer, no weights. Empty
    without a section."""
    section = cfg.reward_model
    if section is None or not section.model_path:
        return []
    from transformers import AutoConfig

    path = section.model_path
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=section.trust_remote_code)
    except Exception as exc:  # the user's directory, however transformers refuses it
        return [f"reward_model.model_path: transformers cannot read the model config in {path!r}: {first_line(exc)}"]
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):  # (a critic's export has a bias)
        return [
            f"reward_model.model_path: {path!r} holds {', '.join(architectures) or 'no architectures'}, not a reward "
            "model (a *ForSequenceClassification with num_labels 1, e.g. the rm loop's final_hf/); its score head "
            "would start at zero"
        ]
    if config.num_labels != 1:
        return [f"reward_model.model_path: {path!r} has {config.num_labels} labels; a reward model has 1"]
    return shared_tokenizer_problems(cfg, "reward_model", section, actor_tokenizer)


#: what each role does with the policy's token ids, and what to do instead, for the messages of
#: :func:`shared_tokenizer_problems`
_TOKEN_USE = {
    "ref": ("computes reference log-probs of", "use a reference model of the policy's family"),
    "critic": ("values", "start the critic from the policy's base model"),
    "teacher": (
        "computes the distillation targets on",
        "distil from a teacher that shares the policy's tokenizer (e.g. a larger model of the same family)",
    ),
    "reward_model": (
        "scores",
        "train it with the rm loop from the policy's base model, or serve it as a reward "
        "(reward: {name: reward_model, ...}), which re-tokenises text",
    ),
}


def shared_tokenizer_problems(
    cfg: RunConfig, role: str, section: ActorConfig, actor_tokenizer: Any = None
) -> list[str]:
    """The role model at ``section`` reads the policy's token ids, so it needs the actor's
    tokenizer (``actor_tokenizer``, as preflight loaded it; ``None``: not checked): its vocabulary
    (token -> id) must equal the actor's, unless it names the actor's own tokenizer directory, and
    its embedding must have a row for every id."""
    if actor_tokenizer is None or not section.model_path:
        return []
    from transformers import AutoConfig, AutoTokenizer

    actor_path = cfg.actor.tokenizer_path or cfg.actor.model_path
    role_path = section.tokenizer_path or section.model_path
    key = f"{role}.tokenizer_path" if section.tokenizer_path else f"{role}.model_path"
    uses, instead = _TOKEN_USE[role]
    actor_vocab = actor_tokenizer.get_vocab()
    if Path(role_path).resolve() == Path(actor_path).resolve():
        role_vocab = actor_vocab
    else:
        try:
            role_vocab = AutoTokenizer.from_pretrained(
                role_path, local_files_only=True, trust_remote_code=section.trust_remote_code
            ).get_vocab()
        except Exception as exc:  # the user's directory, however transformers refuses it
            return [f"{key}: cannot load the tokenizer to compare with the actor's ({actor_path!r}): {first_line(exc)}"]
    if role_vocab != actor_vocab:
        differ = sum(role_vocab.get(token) != i for token, i in actor_vocab.items())
        return [
            f"{key}: the tokenizer in {role_path!r} is not the actor's ({actor_path!r}): {differ} of the actor's "
            f"{len(actor_vocab)} tokens have another id or none (it has {len(role_vocab)}); the {role} {uses} the "
            f"policy's token ids, so it needs the policy's tokenizer: {instead}"
        ]
    try:
        config = AutoConfig.from_pretrained(
            section.model_path, local_files_only=True, trust_remote_code=section.trust_remote_code
        )
    except Exception:  # the model directory's own check reports it
        return []
    largest = max(actor_vocab.values(), default=-1)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(vocab_size, int) and vocab_size <= largest:
        return [
            f"{role}.model_path: its embedding has {vocab_size} rows, but the actor's tokenizer has ids up to "
            f"{largest}; the {role} {uses} the policy's token ids"
        ]
    return []


def fused_head_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """``fused_head: true`` on a role with a scalar head (critic, reward model: no vocabulary), or
    whose train engine does not say it honours it (``fused_head = True`` on its config class)."""
    problems = []
    for role, section in (("actor", cfg.actor), *role_sections(cfg)):
        if not section.fused_head:
            continue
        if role in ("critic", "reward_model"):
            problems.append(f"{role}.fused_head: the {role} has a scalar head, no vocabulary to fuse; set it to false")
            continue
        entry = host.registries[TRAIN_ENGINE.key].get(section.engine.name)
        if entry is not None and not getattr(entry.config_cls, "fused_head", False):
            problems.append(
                f"{role}.fused_head: train engine {entry.name!r} (distribution {entry.distribution}) does not "
                "compute log-probs from the head's weight (its config class does not set fused_head = True); "
                "set it to false, or use an engine that does, e.g. fsdp"
            )
    return problems


def missing_head_problem(entry: RegistryEntry, head: str, key: str, model: str) -> str:
    """The message for a train engine (``entry``, selected at config ``key``) whose config class
    lists no ``head``, which ``model`` (e.g. "a value model") needs: names the engine and its
    distribution and what to do."""
    return (
        f"{key}: train engine {entry.name!r} (distribution {entry.distribution}) cannot build {model} "
        f"(its config class lists no {head!r} head); use an engine that does, e.g. fsdp"
    )


def build_engine(
    host: PluginHost,
    section: ActorConfig,
    *,
    trainable: bool,
    head: str = "lm",
    built: list[BuiltEngine] | None = None,
    role: str = "actor",
) -> TrainEngine:
    """The train engine of one role section (``head`` is passed only for a value or score model, so
    engines without those heads keep their factory signature). With ``built``, a
    :class:`~core_rl.roles.built_engines.BuiltEngine` for ``role`` is appended to it (the device memory
    the build took included), for the ``auto`` micro-batch budgets and the memory metrics."""
    entry = host.get(TRAIN_ENGINE, section.engine.name)
    kwargs: dict[str, Any] = {"trainable": trainable}
    if head != "lm":
        kwargs["head"] = head
    before = cuda_allocated()
    engine = build_component(entry, section, section.engine.config, **kwargs)
    if built is not None:
        built.append(BuiltEngine(role, section, engine, trainable, head, weight_bytes_since(before, engine)))
    return engine


@attrs.define
class Roles:
    """The models of a run besides the actor (``None`` where the run has no such role)."""

    ref: TrainEngine | None = None
    critic: TrainEngine | None = None
    teacher: TrainEngine | None = None
    reward_model: TrainEngine | None = None

    def engines(self) -> list[TrainEngine]:
        return [e for e in (self.ref, self.critic, self.teacher, self.reward_model) if e is not None]

    def close(self) -> None:
        for engine in self.engines():
            engine.close()
        self.ref = self.critic = self.teacher = self.reward_model = None


def build_roles(
    cfg: RunConfig,
    host: PluginHost,
    *,
    needs_reference: bool,
    needs_values: bool,
    built: list[BuiltEngine] | None = None,
) -> Roles:
    """Build the reference (when ``needs_reference``: from ``ref:`` or the actor's section, frozen),
    the critic, the teacher and the reward model (from their sections), each noted in ``built``
    (see :func:`build_engine`). A critic the algorithm does
    not use, or an algorithm needing values without a critic, is a
    :class:`~core_rl.errors.ConfigError`. The role sections' model directories (and
    :func:`reward_model_problems`) were checked by :func:`core_rl.loops.preflight.preflight`."""
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
            roles.ref = build_engine(host, cfg.ref or cfg.actor, trainable=False, built=built, role="ref")
        if cfg.critic is not None:
            roles.critic = build_engine(host, cfg.critic, trainable=True, head="value", built=built, role="critic")
        if cfg.teacher is not None:
            roles.teacher = build_engine(host, cfg.teacher, trainable=False, built=built, role="teacher")
        if cfg.reward_model is not None:
            roles.reward_model = build_engine(
                host, cfg.reward_model, trainable=False, head="score", built=built, role="reward_model"
            )
    except BaseException:
        roles.close()
        raise
    return roles
