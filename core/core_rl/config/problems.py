"""Checks of a validated run configuration as a whole: what the selected loop needs
(:func:`completeness_problems`), the core's sections against each other
(:func:`cross_section_problems`, :func:`schedule_problems`, :func:`eval_problems`), the rollout
engine's weight-sync mode and each plugin section's own ``check_config``
(:func:`plugin_check_problems`); ``rollout.dump`` and ``rollout.replay_from`` against the rest
(:func:`replay_config_problems`). Each returns one message per problem, naming its key path and what
to do."""

from __future__ import annotations

from typing import Any

from core_rl.config.checks import SectionContext, config_problems
from core_rl.config.reward_aggregation import reward_aggregation_problems
from core_rl.config.schema import DataConfig, RunConfig, SchedulerConfig, mismatch_budget_problems
from core_rl.config.sections import selected_sections
from core_rl.config.validators import MAX_COUNT, FieldValueError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LOOP, ROLLOUT_ENGINE
from core_rl.roles.build import OPTIONAL_ROLES, role_sections
from core_rl.rollout.chat_template import CHAT_TEMPLATE_ARGUMENTS


def uses_rl_sections(cfg: RunConfig, host: PluginHost | None = None) -> bool:
    """Whether the selected loop uses the RL sections (``reward``, ``algorithm.advantage``,
    ``algorithm.loss``): unless its config class says ``rl_sections = False``. A loop section that
    failed validation is judged by its registered config class; an unknown loop (reported already)
    by whether it is the default ``rl``."""
    spec = cfg.trainer.loop
    if spec.config is not None:
        return bool(getattr(spec.config, "rl_sections", True))
    entry = spec.entry or (host.registries[LOOP.key].get(spec.name) if host is not None else None)
    if entry is None:
        return spec.name == "rl"
    return bool(getattr(entry.config_cls, "rl_sections", True))


def resets_reference(cfg: RunConfig, host: PluginHost | None = None) -> bool:
    """Whether the selected loop resets its reference (``algorithm.reference_reset_every_n_steps``,
    :mod:`core_rl.loops.rl.reference_reset`): its config class's ``resets_reference`` attribute, else
    whether it uses the RL sections. An unknown loop (reported already) counts as one that does."""
    spec = cfg.trainer.loop
    config_cls: Any = type(spec.config) if spec.config is not None else None
    if config_cls is None:
        entry = spec.entry or (host.registries[LOOP.key].get(spec.name) if host is not None else None)
        if entry is None:
            return True
        config_cls = entry.config_cls
    return bool(getattr(config_cls, "resets_reference", uses_rl_sections(cfg, host)))


def loop_roles(cfg: RunConfig, host: PluginHost | None = None) -> tuple[str, ...] | None:
    """The optional role sections (:data:`core_rl.roles.build.OPTIONAL_ROLES`) the selected loop reads:
    its config class's ``roles`` attribute, else all of them for a loop that uses the RL sections
    and none for one that does not. ``None`` when the loop is unknown (reported already)."""
    spec = cfg.trainer.loop
    config_cls: Any = type(spec.config) if spec.config is not None else None
    if config_cls is None:
        entry = spec.entry or (host.registries[LOOP.key].get(spec.name) if host is not None else None)
        if entry is None and spec.name != "rl":
            return None
        config_cls = entry.config_cls if entry is not None else None
    default = OPTIONAL_ROLES if uses_rl_sections(cfg, host) else ()
    return tuple(getattr(config_cls, "roles", default))


def _unused_role_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    """A role section the selected loop never reads would be ignored silently: refused."""
    roles = loop_roles(cfg, host)
    if roles is None:
        return []
    spec = cfg.trainer.loop
    entry = spec.entry or (host.registries[LOOP.key].get(spec.name) if host is not None else None)
    where = f"the {spec.name!r} loop" + (f" (distribution {entry.distribution})" if entry is not None else "")
    reads = f"it reads {', '.join(r + ':' for r in roles)}" if roles else "it reads no role section"
    return [
        f"{role}: {where} does not use a {role}: section ({reads}); remove the section, or select a loop that "
        "uses it (trainer.loop.name: rl)"
        for role, _ in role_sections(cfg)
        if role not in roles
    ]


def completeness_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    problems = []
    if not cfg.actor.model_path:
        problems.append("actor.model_path: required; the path of a Hugging Face model directory")
    problems.extend(_unused_role_problems(cfg, host))
    if uses_rl_sections(cfg, host):
        problems.extend(_rl_completeness_problems(cfg))
    if cfg.algorithm.reference_reset_every_n_steps and not resets_reference(cfg, host):
        problems.append(
            f"algorithm.reference_reset_every_n_steps: the {cfg.trainer.loop.name!r} loop does not reset its "
            "reference (the rl and dpo loops do); remove it"
        )
    if cfg.algorithm.reference_reset_alpha != 1.0 and not cfg.algorithm.reference_reset_every_n_steps:
        problems.append(
            "algorithm.reference_reset_alpha: mixes the policy into the reference at each reset, and "
            "algorithm.reference_reset_every_n_steps is 0 (no resets); set it, or remove reference_reset_alpha"
        )
    if cfg.algorithm.reference_reset_optimizer and not cfg.algorithm.reference_reset_every_n_steps:
        problems.append(
            "algorithm.reference_reset_optimizer: drops the actor's optimizer state at each reference reset, and "
            "algorithm.reference_reset_every_n_steps is 0 (no resets); set it, or remove reference_reset_optimizer"
        )
    problems.extend(replay_config_problems(cfg, rl_loop=uses_rl_sections(cfg, host)))
    problems.extend(max_length_problems(cfg, host))
    problems.extend(difficulty_filter_problems(cfg, rl_loop=uses_rl_sections(cfg, host)))
    problems.extend(ptx_problems(cfg, rl_loop=uses_rl_sections(cfg, host)))
    problems.extend(reward_aggregation_problems(cfg, rl_loop=uses_rl_sections(cfg, host)))
    if not cfg.data.train_files:
        problems.append(
            "data.train_files: required; a list of JSON/JSONL/Parquet files, saved datasets or hf: datasets of prompts"
        )
    if cfg.eval is not None and not cfg.eval.files:
        problems.append(
            "eval.files: required with an eval: section; a list of JSON/JSONL/Parquet files, saved datasets or hf: "
            "datasets of prompts"
        )
    return problems


def max_length_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    """``data.truncation`` without ``data.max_length``, and ``data.max_length`` for a loop it does
    not bound: the rl loop (its lengths are ``data.max_prompt_tokens`` and
    ``rollout.sampling.max_new_tokens``) or a loop whose config class has no ``row_sequences``
    (:class:`core_rl.loops.supervised.sequences.BuildsSequences`)."""
    data, spec = cfg.data, cfg.trainer.loop
    if data.truncation is not None and data.max_length is None:
        return [
            f"data.truncation: {data.truncation} says what to do with rows longer than data.max_length, which is "
            "unset; set data.max_length, or remove data.truncation"
        ]
    if data.max_length is None:
        return []
    if uses_rl_sections(cfg, host):
        return [
            f"data.max_length: bounds the sequences of the supervised loops (sft, dpo, kto, rm), not the "
            f"{spec.name!r} loop, whose prompts data.max_prompt_tokens bounds and whose responses "
            "rollout.sampling.max_new_tokens; remove data.max_length"
        ]
    if spec.config is not None and not callable(getattr(spec.config, "row_sequences", None)):
        return [
            f"data.max_length: the {spec.name!r} loop does not say which sequences it builds from a row (its config "
            "class has no row_sequences), so nothing would bound them; remove data.max_length"
        ]
    return []


def keep_best_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    """``saver.keep_best`` ranking the RL loop's checkpoints by an evaluation metric that no
    checkpoint's step logs: no ``eval:`` section, or checkpoints every ``saver.every_n_steps`` on
    steps that ``eval.every_n_steps`` does not evaluate."""
    best = cfg.saver.keep_best
    if not best.count or not best.metric.startswith("eval/") or not uses_rl_sections(cfg, host):
        return []
    key = f"saver.keep_best.metric: {best.metric!r} is an evaluation metric"
    if cfg.eval is None:
        return [f"{key}, and the run has no eval: section; add one, or rank by a training metric such as 'reward'"]
    saves, evals = cfg.saver.every_n_steps, cfg.eval.every_n_steps
    if saves and (not evals or saves % evals):
        return [
            f"{key}, and the checkpoints of saver.every_n_steps={saves} fall on steps eval.every_n_steps={evals} does "
            "not evaluate; make saver.every_n_steps a multiple of eval.every_n_steps"
        ]
    return []


def eval_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    """An ``eval:`` section the run could not honour: a loop that samples nothing, no rule reward
    to score answers with, greedy decoding asked for several answers, or sampling settings that
    contradict each other once merged into ``rollout.sampling``."""
    if cfg.eval is None:
        return []
    if not uses_rl_sections(cfg, host):
        return [
            f"eval: trainer.loop.name is {cfg.trainer.loop.name!r}, a loop that generates no answers to evaluate "
            "(evaluation runs in the rl loop); remove the eval: section"
        ]
    problems = []
    if cfg.reward is None:
        problems.append(
            "eval: answers are scored by the run's reward: section, and this run has none (a reward_model: role "
            "scores training batches only); add a reward: section, or remove eval:"
        )
    sampling = cfg.eval.sampling
    if sampling.greedy and sampling.n > 1:
        problems.append(
            f"eval.sampling.n: greedy decoding (eval.sampling.greedy: true, the default) gives the same answer "
            f"{sampling.n} times; set eval.sampling.greedy: false (and a temperature) to sample {sampling.n} answers, "
            "or n: 1"
        )
    try:
        sampling.resolve(cfg.rollout.sampling)
    except FieldValueError as exc:
        problems.append(
            f"eval.sampling: merged into rollout.sampling, {exc.field} {exc.requirement}, got {exc.value!r}; "
            "make the two sections agree"
        )
    batch = cfg.eval.prompts_per_batch(MAX_COUNT, cfg.data.batch_size)  # auto: within the bound by itself
    if batch * sampling.n > MAX_COUNT:
        problems.append(
            f"eval.batch_size: {batch} prompts x eval.sampling.n={sampling.n} answers is more than {MAX_COUNT} "
            "samples per generation batch; lower one of them"
        )
    return problems


def _rl_completeness_problems(cfg: RunConfig) -> list[str]:
    """What a loop that uses the RL sections needs: an advantage estimator, a policy loss, a reward."""
    problems = []
    if not cfg.algorithm.name and (cfg.algorithm.advantage is None or cfg.algorithm.loss is None):
        problems.append("algorithm.name: required (e.g. grpo), or set both algorithm.advantage and algorithm.loss")
    else:
        if cfg.algorithm.advantage is None:
            problems.append(
                f"algorithm.advantage: algorithm {cfg.algorithm.name!r} sets no advantage estimator; set one"
            )
        if cfg.algorithm.loss is None:
            problems.append(f"algorithm.loss: algorithm {cfg.algorithm.name!r} sets no policy loss; set one")
    if cfg.reward is None and cfg.reward_model is None:
        problems.append(
            "reward: required; select a reward, e.g. reward: {name: exact_match}, or add a reward_model: section"
        )
    return problems


def weight_sync_problems(host: PluginHost, cfg: RunConfig) -> list[str]:
    """``rollout.weight_sync`` must be a mode the selected rollout engine declares (the
    ``weight_sync_modes`` attribute of its ``config_cls``; ``memory`` and ``disk`` without one)."""
    entry = host.registries[ROLLOUT_ENGINE.key].get(cfg.rollout.engine.name)
    if entry is None:
        return []  # the unknown name is reported already
    modes = tuple(getattr(entry.config_cls, "weight_sync_modes", ("memory", "disk")))
    if cfg.rollout.weight_sync in modes:
        return []
    return [
        f"rollout.weight_sync: rollout engine {entry.name!r} ({entry.distribution}) does not support "
        f"{cfg.rollout.weight_sync!r}; it supports {', '.join(modes)}"
    ]


def sampling_extra_problems(host: PluginHost, cfg: RunConfig) -> list[str]:
    """``rollout.sampling.extra`` (and ``eval.sampling.extra``) needs a rollout engine that passes
    it on (the ``sampling_extra`` attribute of its ``config_cls``; absent: it does not, e.g. ``hf``,
    which samples in process), and may not name what that engine sets itself (its ``request_keys``)."""
    entry = host.registries[ROLLOUT_ENGINE.key].get(cfg.rollout.engine.name)
    sections = [("rollout.sampling.extra", cfg.rollout.sampling.extra)]
    if cfg.eval is not None and cfg.eval.sampling.extra is not None:
        sections.append(("eval.sampling.extra", cfg.eval.sampling.extra))
    problems = []
    for key, extra in sections:
        if not extra or entry is None:
            continue
        engine = f"rollout engine {entry.name!r} ({entry.distribution})"
        if not getattr(entry.config_cls, "sampling_extra", False):
            problems.append(
                f"{key}: {', '.join(sorted(extra))}: {engine} does not pass server parameters on; remove them, or "
                "use an engine that does (vllm, sglang)"
            )
            continue
        taken = sorted(set(extra) & set(getattr(entry.config_cls, "request_keys", ())))
        if taken:
            problems.append(
                f"{key}: {', '.join(taken)}: {engine} sets them in its requests itself; remove them from extra "
                "(rollout.sampling's own keys set what it samples)"
            )
    return problems


def engine_releases_memory(host: PluginHost, cfg: RunConfig) -> bool | None:
    """Whether the selected rollout engine can give back its memory while the trainer trains (the
    ``releases_memory`` attribute of its ``config_cls``; absent: it cannot); ``None`` for an
    unknown engine name (reported already)."""
    entry = host.registries[ROLLOUT_ENGINE.key].get(cfg.rollout.engine.name)
    return None if entry is None else bool(getattr(entry.config_cls, "releases_memory", False))


def cross_section_problems(cfg: RunConfig) -> list[str]:
    """Checks of the core's own sections against each other."""
    problems = []
    samples = cfg.data.batch_size * cfg.rollout.sampling.n
    if samples > MAX_COUNT:
        problems.append(
            f"data.batch_size: {cfg.data.batch_size} prompts x rollout.sampling.n={cfg.rollout.sampling.n} samples "
            f"is {samples} samples per step, more than {MAX_COUNT}; lower one of them"
        )
    shaping = cfg.algorithm.reward_shaping
    budget = cfg.rollout.sampling.max_new_tokens
    if shaping.overlong_tokens is not None and shaping.overlong_tokens > budget:
        problems.append(
            f"algorithm.reward_shaping.overlong_tokens: must be <= rollout.sampling.max_new_tokens ({budget}), "
            f"got {shaping.overlong_tokens}"
        )
    if cfg.trainer.total_steps:  # else derived from trainer.total_epochs at the start (config/epochs.py)
        problems.extend(step_count_problems(cfg))
    problems.extend(chat_template_problems(cfg.data))
    if cfg.algorithm.ppo_n_minibatches > samples:
        problems.append(
            f"algorithm.ppo_n_minibatches: must be <= the samples of a step, data.batch_size x rollout.sampling.n "
            f"= {samples}, got {cfg.algorithm.ppo_n_minibatches}"
        )
    problems.extend(restart_problems(cfg))
    problems.extend(
        mismatch_budget_problems(cfg.algorithm.mismatch_budget, rejection_sampling=cfg.algorithm.rejection_sampling)
    )
    return problems


def restart_problems(cfg: RunConfig) -> list[str]:
    """Automatic restarts (``recover.mode: auto``, or ``trainer.resume: true``, with ``recover.retries``)
    resume from this run's own checkpoints: saved without optimizer state
    (``saver.save_optimizer: false``), they would be refused by ``recover.load_optimizer: true`` at
    the first restart, so the pair is refused now."""
    auto = cfg.recover.mode == "auto" or (cfg.recover.mode == "disabled" and cfg.trainer.resume)
    if not (auto and cfg.recover.retries and not cfg.saver.save_optimizer and cfg.recover.load_optimizer):
        return []
    return [
        "saver.save_optimizer: false writes checkpoints without optimizer state, and recover.mode: auto restarts a "
        f"crashed run from them (recover.retries: {cfg.recover.retries}), which recover.load_optimizer: true refuses; "
        "set recover.load_optimizer: false (each restart then goes on with a fresh optimizer), or recover.retries: 0"
    ]


def step_count_problems(cfg: RunConfig) -> list[str]:
    """What ``trainer.total_steps`` must agree with: the learning-rate schedules
    (:func:`schedule_problems`) and the profiled steps. Checked when the configuration loads, or
    when the run starts where ``trainer.total_epochs`` derives the count then."""
    steps = cfg.trainer.total_steps
    problems = schedule_problems(cfg)
    late = [s for s in cfg.trainer.profile.steps if s > steps]
    if late:
        problems.append(
            f"trainer.profile.steps: {late} {'is' if len(late) == 1 else 'are'} after the last step "
            f"(trainer.total_steps={steps}{_from_epochs(cfg)}); list steps from 1 to {steps}"
        )
    return problems


def _from_epochs(cfg: RunConfig) -> str:
    """How ``trainer.total_steps`` came about, when ``trainer.total_epochs`` derived it."""
    epochs = cfg.trainer.total_epochs
    return f" derived from trainer.total_epochs={epochs}" if epochs is not None else ""


def chat_template_problems(data: DataConfig) -> list[str]:
    """``data.system_prompt``, ``data.chat_template_kwargs`` and ``data.chat_template`` need the chat template, and the
    variables must not be the tokenizer's own arguments (:data:`CHAT_TEMPLATE_ARGUMENTS`)."""
    problems = []
    if not data.apply_chat_template:
        for key in ("system_prompt", "chat_template_kwargs", "chat_template"):
            if getattr(data, key):
                problems.append(f"data.{key}: applies only with the chat template; set data.apply_chat_template: true")
    taken = sorted(set(data.chat_template_kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if taken:
        problems.append(
            f"data.chat_template_kwargs: {', '.join(taken)} {'is an argument' if len(taken) == 1 else 'are arguments'} "
            "core-rl sets itself, not a template variable; remove it"
        )
    return problems


def plugin_check_problems(cfg: RunConfig) -> list[str]:
    """Each validated plugin section's own ``check_config`` (see :mod:`core_rl.config.checks`)."""
    problems: list[str] = []
    for path, _kind, spec in selected_sections(cfg):
        if spec.config is not None:
            problems.extend(config_problems(spec.config, SectionContext(path=path, run=cfg, name=spec.name)))
    return problems


def schedule_problems(cfg: RunConfig) -> list[str]:
    """A ``linear`` or ``cosine`` schedule decaying to learning rate 0 (``min_lr_ratio: 0``)
    before the run's last optimiser step would train the remaining steps at learning rate 0: a
    ``total_steps`` set below the run's (e.g. recorded by an earlier run, then extended)."""
    run_steps = cfg.trainer.total_steps * cfg.algorithm.optimizer_steps_per_step
    schedules: list[tuple[str, SchedulerConfig]] = [("actor", cfg.actor.lr_scheduler)]
    if cfg.critic is not None:
        schedules.append(("critic", cfg.critic.lr_scheduler))
    problems = []
    for role, schedule in schedules:
        problems += _wsd_problems(role, schedule)
        if schedule.name == "constant" or schedule.min_lr_ratio > 0 or schedule.total_steps >= run_steps:
            continue
        problems.append(
            f"{role}.lr_scheduler.total_steps: the {schedule.name} schedule reaches learning rate 0 at optimiser "
            f"step {schedule.total_steps}, but the run takes {run_steps} (trainer.total_steps="
            f"{cfg.trainer.total_steps}{_from_epochs(cfg)} x {cfg.algorithm.optimizer_steps_per_step} optimiser "
            "step(s) per step), so "
            f"its last {run_steps - schedule.total_steps} optimiser steps would not train; set "
            f"{role}.lr_scheduler.total_steps=0 (the default: follow trainer.total_steps) or at least {run_steps}, "
            f"or {role}.lr_scheduler.min_lr_ratio above 0"
        )
    return problems


def _wsd_problems(role: str, schedule: SchedulerConfig) -> list[str]:
    """A ``wsd`` schedule's warmup must end before its decay starts."""
    if schedule.name != "wsd" or schedule.total_steps <= 0:
        return []
    decay = schedule.wsd_decay_steps
    if schedule.warmup_steps + decay <= schedule.total_steps:
        return []
    return [
        f"{role}.lr_scheduler: the wsd warmup ({schedule.warmup_steps} optimiser steps) overlaps its decay (the last "
        f"{decay} of {schedule.total_steps}: decay_ratio={schedule.decay_ratio}); lower warmup_steps/warmup_ratio "
        "or decay_ratio"
    ]


def replay_config_problems(cfg: RunConfig, *, rl_loop: bool) -> list[str]:
    """What a run with ``rollout.replay_from`` or ``rollout.dump`` cannot combine with, one line
    each naming the key path and what to do. ``rl_loop``: the selected loop uses the RL sections
    (only it generates rollouts)."""
    rollout = cfg.rollout
    problems: list[str] = []
    if not rl_loop:
        if rollout.replay_from is not None:
            problems.append(f"rollout.replay_from: the {cfg.trainer.loop.name!r} loop generates no rollouts; remove it")
        if rollout.dump.every_n_steps:
            problems.append(
                f"rollout.dump.every_n_steps: the {cfg.trainer.loop.name!r} loop generates no rollouts; set 0"
            )
        return problems
    if rollout.replay_from is None:
        return problems
    why = "a replay run (rollout.replay_from) builds no rollout engine and calls no reward"
    if rollout.dump.every_n_steps:
        problems.append(f"rollout.dump.every_n_steps: {why}, so it has nothing new to dump; set 0")
    if cfg.eval is not None:
        problems.append(f"eval: {why}, so it cannot evaluate; remove the eval: section")
    if cfg.reward_model is not None:
        problems.append(
            f"reward_model: {why}; the dumped rewards are the rule rewards alone, so remove the reward_model: "
            "section (or train on fresh rollouts without rollout.replay_from)"
        )
    return problems


def difficulty_filter_problems(cfg: RunConfig, *, rl_loop: bool) -> list[str]:
    """A ``data.difficulty_filter`` that would do nothing: a loop that scores no rollouts (the
    supervised ones), a replay run (its batches are the saved ones), or no rule reward to measure
    prompts by (:mod:`core_rl.loops.rl.difficulty`)."""
    if cfg.data.difficulty_filter is None:
        return []
    key = "data.difficulty_filter"
    if not rl_loop:
        return [
            f"{key}: the {cfg.trainer.loop.name!r} loop scores no rollouts, so no prompt is ever measured (the filter "
            "is for the rl loop); remove it"
        ]
    if cfg.rollout.replay_from is not None:
        return [
            f"{key}: a replay run (rollout.replay_from) trains on the saved batches and draws no prompts; remove it"
        ]
    if cfg.reward is None:
        return [
            f"{key}: prompts are measured by the rule reward (the reward: section) and this run has none (a "
            "reward_model: role's scores are not used); add a reward: section, or remove the filter"
        ]
    return []


def ptx_problems(cfg: RunConfig, *, rl_loop: bool) -> list[str]:
    """``algorithm.ptx`` with a loop whose updates are not the rl loop's policy updates."""
    if cfg.algorithm.ptx is None or rl_loop:
        return []
    return [
        f"algorithm.ptx: mixes supervised rows into the rl loop's policy updates, and this run's loop is "
        f"{cfg.trainer.loop.name!r} (the sft loop trains on such rows by itself); remove it"
    ]
