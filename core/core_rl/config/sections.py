"""The plugin sections of a run configuration: which a configuration selects
(:func:`selected_sections`), where they sit in unstructured data (:data:`RAW_SPEC_PATHS`), and
their validation by the selected plugin's own ``config_cls`` (:func:`validate_plugin_section`),
nested sections included."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from core_rl.config.converter import TypeMismatch, join_path, structure, structure_plugin_spec
from core_rl.config.derived import record_default
from core_rl.config.overrides import format_path
from core_rl.config.paths import node_at
from core_rl.config.plugin_spec import DEFAULT_FROM, PLUGIN_KIND_METADATA
from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.config.validators import FieldValueError
from core_rl.errors import ConfigError, PluginError
from core_rl.plugins import kinds
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import PluginKind
from core_rl.roles.build import OPTIONAL_ROLES, role_sections


def selected_sections(cfg: RunConfig) -> Iterator[tuple[str, PluginKind, PluginSpec]]:
    """Every plugin section ``cfg`` selects: ``(key path, kind, spec)``."""
    yield "actor.engine", kinds.TRAIN_ENGINE, cfg.actor.engine
    for role, section in role_sections(cfg):
        yield f"{role}.engine", kinds.TRAIN_ENGINE, section.engine
    yield "rollout.engine", kinds.ROLLOUT_ENGINE, cfg.rollout.engine
    yield "rollout.workflow", kinds.WORKFLOW, cfg.rollout.workflow
    if cfg.algorithm.advantage is not None:
        yield "algorithm.advantage", kinds.ADVANTAGE, cfg.algorithm.advantage
    if cfg.algorithm.loss is not None:
        yield "algorithm.loss", kinds.POLICY_LOSS, cfg.algorithm.loss
    for i, spec in enumerate(cfg.algorithm.filters):
        yield f"algorithm.filters[{i}]", kinds.SAMPLE_FILTER, spec
    if cfg.algorithm.rejection_sampling is not None:
        yield "algorithm.rejection_sampling", kinds.REJECTION_SAMPLER, cfg.algorithm.rejection_sampling
    yield "algorithm.mismatch_budget.correction", kinds.REJECTION_SAMPLER, cfg.algorithm.mismatch_budget.correction
    if cfg.reward is not None:
        yield "reward", kinds.REWARD, cfg.reward
    for i, spec in enumerate(cfg.loggers):
        yield f"loggers[{i}]", kinds.LOGGER, spec
    yield "trainer.loop", kinds.LOOP, cfg.trainer.loop
    for key, spec in cfg.data.sources.items():
        yield f"data.sources.{key}", kinds.DATA_SOURCE, spec
    yield "launcher", kinds.LAUNCHER, cfg.launcher


def _run_value(run: RunConfig, dotted: str) -> Any:
    node: Any = run
    for key in dotted.split("."):
        node = getattr(node, key)
    return node


def validate_plugin_section(
    host: PluginHost, kind: PluginKind, spec: PluginSpec, path: str, *, run: RunConfig | None = None
) -> None:
    """Resolve ``spec.name`` in ``kind``'s registry and validate its options by the plugin's class.

    With ``run``, fields declared with :func:`core_rl.config.schema.default_from` that the section
    leaves unset (or ``null``) take their value from ``run``, recorded as derived
    (:func:`core_rl.config.derived.record_default`)."""
    try:
        entry = host.get(kind, spec.name)
    except PluginError as exc:
        raise ConfigError([f"{path}.name: {exc}"]) from None
    if entry.config_cls is None:
        if spec.options:
            raise ConfigError(
                [
                    f"{path}: {kind.label} {spec.name!r} takes no options, got "
                    f"{', '.join(sorted(map(str, spec.options)))}"
                ]
            )
        spec.entry = entry
        return
    options = dict(spec.options)
    if run is not None:
        for field in attrs.fields(entry.config_cls):
            source = field.metadata.get(DEFAULT_FROM)
            if source is not None and options.get(field.name) is None:
                options[field.name] = _run_value(run, source)
                record_default(run, join_path(path, field.name), options[field.name], source)
    spec.config = structure(options, entry.config_cls, path=path)
    nested = _nested_section_problems(host, spec.config, path, run)
    if nested:
        raise ConfigError(nested)
    spec.entry = entry


def _nested_section_problems(host: PluginHost, config: Any, path: str, run: RunConfig | None) -> list[str]:
    """Validate the plugin sections nested in a plugin's validated ``config``: every field declared
    with :func:`core_rl.config.schema.plugin_section` (a spec, a list of them or a dict of them), found at any
    depth of attrs classes and lists; return one message per problem."""
    problems: list[str] = []
    if not attrs.has(type(config)):
        return problems
    for field in attrs.fields(type(config)):
        kind = field.metadata.get(PLUGIN_KIND_METADATA)
        value = getattr(config, field.name)
        field_path = join_path(path, field.name)
        items = [(join_path(field_path, i), v) for i, v in enumerate(value)] if isinstance(value, list) else []
        if isinstance(value, dict):
            items = [(join_path(field_path, k), v) for k, v in value.items()]
        for item_path, item in items or [(field_path, value)]:
            if kind is not None and isinstance(item, PluginSpec):
                try:
                    validate_plugin_section(host, kind, item, item_path, run=run)
                except ConfigError as exc:
                    problems.extend(exc.problems)
            else:
                problems.extend(_nested_section_problems(host, item, item_path, run))
    return problems


#: where plugin sections sit in unstructured data: ``(keys, kind, whether it is a list of sections)``
RAW_SPEC_PATHS: tuple[tuple[tuple[str, ...], PluginKind, bool], ...] = (
    (("actor", "engine"), kinds.TRAIN_ENGINE, False),
    *(((role, "engine"), kinds.TRAIN_ENGINE, False) for role in OPTIONAL_ROLES),
    (("rollout", "engine"), kinds.ROLLOUT_ENGINE, False),
    (("rollout", "workflow"), kinds.WORKFLOW, False),
    (("algorithm", "advantage"), kinds.ADVANTAGE, False),
    (("algorithm", "loss"), kinds.POLICY_LOSS, False),
    (("algorithm", "filters"), kinds.SAMPLE_FILTER, True),
    (("algorithm", "rejection_sampling"), kinds.REJECTION_SAMPLER, False),
    (("algorithm", "mismatch_budget", "correction"), kinds.REJECTION_SAMPLER, False),
    (("reward",), kinds.REWARD, False),
    (("loggers",), kinds.LOGGER, True),
    (("trainer", "loop"), kinds.LOOP, False),
    (("launcher",), kinds.LAUNCHER, False),
)


def raw_plugin_sections(data: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], PluginKind]]:
    """The plugin sections present in unstructured ``data``: ``(path, kind)``."""
    for keys, kind, is_list in RAW_SPEC_PATHS:
        node = node_at(data, keys)
        if node is None:
            continue
        if is_list and isinstance(node, list):
            for i in range(len(node)):
                yield (*keys, i), kind
        elif not is_list:
            yield keys, kind


def is_plugin_section(path: tuple[Any, ...]) -> bool:
    for keys, _kind, is_list in RAW_SPEC_PATHS:
        if path[: len(keys)] == keys and len(path) == len(keys) + (1 if is_list else 0):
            return not is_list or isinstance(path[-1], int)
    return False


def raw_plugin_problems(data: Mapping[str, Any], host: PluginHost) -> list[str]:
    """Validate the plugin sections found in unstructured ``data`` (used when the rest failed)."""
    problems: list[str] = []
    for path, kind in raw_plugin_sections(data):
        try:
            spec = structure_plugin_spec(node_at(data, path), PluginSpec)
            validate_plugin_section(host, kind, spec, format_path(path))
        except ConfigError as exc:
            problems.extend(exc.problems)
        except (TypeMismatch, FieldValueError):
            pass  # already reported by the main pass
    return problems
