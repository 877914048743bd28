"""Load a run configuration, in this order:

1. the YAML file (OmegaConf), kept unresolved;
2. command-line overrides (:mod:`core_rl.config.overrides`); where one switches a plugin section to
   another plugin (``reward.name=...``), the options that came from the file and that the new
   plugin does not take are dropped, with a note;
3. the selected algorithm's recipe defaults, merged under the result (a section the user points
   at another plugin replaces the recipe's);
4. ``${...}`` interpolation (OmegaConf);
5. typed structuring and validation (cattrs into :mod:`core_rl.config.schema`), then each selected
   plugin's own section by its ``config_cls``, then checks across sections (the core's and each
   plugin's ``check_config``, :mod:`core_rl.config.checks`).

Every problem of the whole configuration is reported at once, each with its key path, e.g.
``actor.optimizer.lr: must be in (0, 10], got 50.0`` or ``actor.optimzer: unknown key; did you mean
'optimizer'?``.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_rl.components import build_component
from core_rl.config.checks import SectionContext, config_problems
from core_rl.config.overrides import apply_overrides, first_line, format_path, parse_overrides
from core_rl.config.schema import DEFAULT_FROM, PLUGIN_KIND_METADATA, PluginSpec, RunConfig
from core_rl.config.validators import MAX_COUNT, FieldValueError
from core_rl.errors import ConfigError, PluginError, did_you_mean
from core_rl.kinds import (
    ADVANTAGE,
    ALGORITHM,
    LOGGER,
    LOOP,
    POLICY_LOSS,
    REJECTION_SAMPLER,
    REWARD,
    ROLLOUT_ENGINE,
    SAMPLE_FILTER,
    TRAIN_ENGINE,
    WORKFLOW,
    PluginKind,
)
from core_rl.plugins import PluginHost
from core_rl.roles import OPTIONAL_ROLES, role_sections


class TypeMismatch(TypeError):
    """A value of the wrong type for its field."""

    def __init__(self, expected: str, value: Any) -> None:
        self.expected = expected
        self.value = value
        super().__init__(f"expected {expected}, got {value!r}")


def _strict_int(value: Any, _t: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeMismatch("an integer", value)
    return value


def _strict_float(value: Any, _t: type) -> float:
    """A finite number: ints and floats, and numeric strings (YAML 1.1 reads ``1e-5`` as one);
    NaN and infinities (``.inf``, ``1e309``) are refused for every float field."""
    if isinstance(value, bool):
        raise TypeMismatch("a number", value)
    number: float | None = None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            raise TypeMismatch("a finite number", value) from None
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise TypeMismatch("a number", value)
    if not math.isfinite(number):
        raise TypeMismatch("a finite number", value)
    return number


def _strict_bool(value: Any, _t: type) -> bool:
    if not isinstance(value, bool):
        raise TypeMismatch("true or false", value)
    return value


def _strict_str(value: Any, _t: type) -> str:
    if not isinstance(value, str):
        raise TypeMismatch("a string", value)
    return value


def _structure_plugin_spec(value: Any, _t: type) -> PluginSpec:
    if isinstance(value, str):
        return PluginSpec(name=value)
    if not isinstance(value, Mapping):
        raise TypeMismatch("a mapping with a 'name' key (or just the name)", value)
    if "name" not in value or not isinstance(value["name"], str) or not value["name"]:
        raise FieldValueError("name", value.get("name"), "must name a registered plugin")
    options = {k: v for k, v in value.items() if k != "name"}
    return PluginSpec(name=value["name"], options=options)


#: what structuring a user's value can raise; anything else is a bug and keeps its traceback
_VALUE_ERRORS = (
    ClassValidationError,
    IterableValidationError,
    ForbiddenExtraKeysError,
    FieldValueError,
    TypeMismatch,
    KeyError,
    ValueError,
)


def _origin_is(kind: type) -> Callable[[Any], bool]:
    return lambda t: getattr(t, "__origin__", None) is kind


def _structure_items(conv: cattrs.Converter, t: Any, items: Iterator[tuple[Any, Any, Any]]) -> list[Any]:
    """Structure ``(index, value, type)`` items, collecting every failure with its index."""
    out, errors = [], []
    for index, item, item_type in items:
        try:
            out.append(conv.structure(item, item_type))
        except _VALUE_ERRORS as exc:
            exc.add_note(IterableValidationNote(f"Structuring {t} @ index {index}", index, item_type))
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {t}", errors, t)
    return out


def _list_hook_factory(conv: cattrs.Converter) -> Any:
    """Structure ``list[X]`` from a list or tuple only (cattrs would split a string into characters),
    reporting each bad item with its index."""

    def factory(t: Any) -> Any:
        item_type = t.__args__[0] if getattr(t, "__args__", None) else Any

        def structure_list(value: Any, _t: Any) -> list[Any]:
            if not isinstance(value, (list, tuple)):
                raise TypeMismatch("a list", value)
            return _structure_items(conv, t, ((i, v, item_type) for i, v in enumerate(value)))

        return structure_list

    return factory


def _tuple_hook_factory(conv: cattrs.Converter) -> Any:
    """Structure ``tuple[X, Y]`` (exactly that many items) or ``tuple[X, ...]`` from a list or
    tuple only: a string such as ``'12'`` is not the pair ``(1.0, 2.0)``."""

    def factory(t: Any) -> Any:
        args = getattr(t, "__args__", ()) or (Any, ...)
        variadic = len(args) == 2 and args[1] is Ellipsis

        def structure_tuple(value: Any, _t: Any) -> tuple[Any, ...]:
            if not isinstance(value, (list, tuple)):
                raise TypeMismatch(f"a list of {'values' if variadic else len(args)}", value)
            if not variadic and len(value) != len(args):
                raise TypeMismatch(f"a list of exactly {len(args)} values", value)
            types = [args[0]] * len(value) if variadic else list(args)
            return tuple(_structure_items(conv, t, ((i, v, types[i]) for i, v in enumerate(value))))

        return structure_tuple

    return factory


def _dict_hook_factory(conv: cattrs.Converter) -> Any:
    """Structure ``dict[K, V]`` from a mapping only, reporting each bad value with its key."""

    def factory(t: Any) -> Any:
        key_type, value_type = getattr(t, "__args__", None) or (Any, Any)

        def structure_dict(value: Any, _t: Any) -> dict[Any, Any]:
            if not isinstance(value, Mapping):
                raise TypeMismatch("a mapping", value)
            keys = _structure_items(conv, t, ((k, k, key_type) for k in value))
            values = _structure_items(conv, t, ((k, v, value_type) for k, v in value.items()))
            return dict(zip(keys, values))

        return structure_dict

    return factory


class _FieldView:
    """Stands in for the instance an attrs validator receives while the instance does not exist
    yet: every field's given (structured) value, else its default."""

    def __init__(self, cls: type, values: Mapping[str, Any]) -> None:
        for a in attrs.fields(cls):
            if a.name in values:
                value = values[a.name]
            elif isinstance(a.default, attrs.Factory):  # type: ignore[arg-type]
                value = None if a.default.takes_self else a.default.factory()
            else:
                value = None if a.default is attrs.NOTHING else a.default
            setattr(self, a.name, value)


def _attrs_hook_factory(conv: cattrs.Converter) -> Any:
    """Structure an attrs config class reporting *every* problem of the section at once: unknown
    keys, missing required keys, each field's type and each field's validators. Checks across
    fields (``__attrs_post_init__``) run once every field is valid."""

    def factory(cls: type) -> Any:
        attrs.resolve_types(cls)
        fields = [a for a in attrs.fields(cls) if a.init]

        def structure_attrs(value: Any, _t: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeMismatch("a mapping", value)
            errors: list[Exception] = []
            known = {a.name for a in fields}
            extra = {k for k in value if k not in known}
            if extra:
                errors.append(ForbiddenExtraKeysError(None, cls, extra))
            given: dict[str, Any] = {}
            for a in fields:
                if a.name not in value:
                    if a.default is attrs.NOTHING:
                        exc: Exception = KeyError(a.name)
                        exc.add_note(AttributeValidationNote(f"Missing {a.name}", a.name, a.type))
                        errors.append(exc)
                    continue
                try:
                    given[a.name] = conv.structure(value[a.name], a.type)
                except _VALUE_ERRORS as exc:
                    exc.add_note(AttributeValidationNote(f"Structuring {cls.__qualname__} @ {a.name}", a.name, a.type))
                    errors.append(exc)
            view = _FieldView(cls, given)
            for a in fields:
                if a.validator is None or a.name not in given:
                    continue
                try:
                    a.validator(view, a, given[a.name])
                except FieldValueError as exc:
                    errors.append(exc)
                except (ValueError, TypeError) as exc:  # attrs' own validators (gt, instance_of, ...)
                    errors.append(FieldValueError(a.name, given[a.name], str(exc)))
            if errors:
                raise ClassValidationError(f"While structuring {cls.__qualname__}", errors, cls)
            return cls(**{a.alias: given[a.name] for a in fields if a.name in given})

        return structure_attrs

    return factory


def make_converter() -> cattrs.Converter:
    """The converter used for every config class: unknown keys are errors, scalars are type-checked,
    and every problem of a section is reported at once."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook_factory(attrs.has, _attrs_hook_factory(conv))
    conv.register_structure_hook_factory(_origin_is(list), _list_hook_factory(conv))
    conv.register_structure_hook_factory(_origin_is(tuple), _tuple_hook_factory(conv))
    conv.register_structure_hook_factory(_origin_is(dict), _dict_hook_factory(conv))
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(PluginSpec, _structure_plugin_spec)
    conv.register_unstructure_hook(PluginSpec, lambda spec: unstructure_spec(conv, spec))
    return conv


def unstructure_spec(conv: cattrs.Converter, spec: PluginSpec) -> dict[str, Any]:
    options = conv.unstructure(spec.config) if spec.config is not None else dict(spec.options)
    return {"name": spec.name, **options}


CONVERTER = make_converter()


_PLAIN_KEY = re.compile(r"[\w-]+")


def _join(path: str, key: Any) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _describe(exc: BaseException, path: str) -> Iterator[str]:
    """Flatten a cattrs validation error tree into one message per problem."""
    if isinstance(exc, ForbiddenExtraKeysError):
        valid = [a.name for a in attrs.fields(exc.cl)]
        for key in sorted(exc.extra_fields, key=str):
            if not isinstance(key, str):
                yield f"{_join(path, repr(key))}: unknown key (keys are names; valid keys: {', '.join(valid)})"
                continue
            close = did_you_mean(key, valid)
            hint = f"; did you mean {close!r}?" if close else f"; valid keys: {', '.join(valid)}"
            shown = key if _PLAIN_KEY.fullmatch(key) else repr(key)  # quote keys like ';' or 'my key'
            yield f"{_join(path, shown)}: unknown key{hint}"
    elif isinstance(exc, ClassValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _describe(sub, _join(path, note.name))
        for sub in without:
            yield from _describe(sub, path)
    elif isinstance(exc, IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            yield from _describe(sub, _join(path, note.index))
        for sub in without:
            yield from _describe(sub, path)
    elif isinstance(exc, FieldValueError):
        yield f"{_join(path, exc.field)}: {exc.requirement}, got {exc.value!r}"
    elif isinstance(exc, TypeMismatch):
        yield f"{path or '<root>'}: expected {exc.expected}, got {exc.value!r}"
    elif isinstance(exc, KeyError):
        yield f"{path}: required key is missing"
    elif isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            yield from _describe(sub, path)
    else:
        yield f"{path or '<root>'}: {exc}"


def structure(data: Any, cls: type, *, path: str = "") -> Any:
    """Structure ``data`` into attrs class ``cls``; raise :class:`ConfigError` naming each key path."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError([f"{path or '<root>'}: expected a mapping, got {data!r}"])
    try:
        return CONVERTER.structure(dict(data), cls)
    except _VALUE_ERRORS as exc:
        raise ConfigError(list(_describe(exc, path))) from None


def selected_sections(cfg: RunConfig) -> Iterator[tuple[str, PluginKind, PluginSpec]]:
    """Every plugin section ``cfg`` selects: ``(key path, kind, spec)``."""
    yield "actor.engine", TRAIN_ENGINE, cfg.actor.engine
    for role, section in role_sections(cfg):
        yield f"{role}.engine", TRAIN_ENGINE, section.engine
    yield "rollout.engine", ROLLOUT_ENGINE, cfg.rollout.engine
    yield "rollout.workflow", WORKFLOW, cfg.rollout.workflow
    if cfg.algorithm.advantage is not None:
        yield "algorithm.advantage", ADVANTAGE, cfg.algorithm.advantage
    if cfg.algorithm.loss is not None:
        yield "algorithm.loss", POLICY_LOSS, cfg.algorithm.loss
    for i, spec in enumerate(cfg.algorithm.filters):
        yield f"algorithm.filters[{i}]", SAMPLE_FILTER, spec
    if cfg.algorithm.rejection_sampling is not None:
        yield "algorithm.rejection_sampling", REJECTION_SAMPLER, cfg.algorithm.rejection_sampling
    if cfg.reward is not None:
        yield "reward", REWARD, cfg.reward
    for i, spec in enumerate(cfg.loggers):
        yield f"loggers[{i}]", LOGGER, spec
    yield "trainer.loop", LOOP, cfg.trainer.loop


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
    leaves unset take their value from ``run``."""
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
            if source is not None and field.name not in options:
                options[field.name] = _run_value(run, source)
    spec.config = structure(options, entry.config_cls, path=path)
    nested = _nested_section_problems(host, spec.config, path, run)
    if nested:
        raise ConfigError(nested)
    spec.entry = entry


def _nested_section_problems(host: PluginHost, config: Any, path: str, run: RunConfig | None) -> list[str]:
    """Validate the plugin sections nested in a plugin's validated ``config``: every field declared
    with :func:`core_rl.config.schema.plugin_section` (a spec, or a list of them), found at any
    depth of attrs classes and lists; return one message per problem."""
    problems: list[str] = []
    if not attrs.has(type(config)):
        return problems
    for field in attrs.fields(type(config)):
        kind = field.metadata.get(PLUGIN_KIND_METADATA)
        value = getattr(config, field.name)
        field_path = _join(path, field.name)
        items = [(_join(field_path, i), v) for i, v in enumerate(value)] if isinstance(value, list) else []
        for item_path, item in items or [(field_path, value)]:
            if kind is not None and isinstance(item, PluginSpec):
                try:
                    validate_plugin_section(host, kind, item, item_path, run=run)
                except ConfigError as exc:
                    problems.extend(exc.problems)
            else:
                problems.extend(_nested_section_problems(host, item, item_path, run))
    return problems


_RAW_SPEC_PATHS: tuple[tuple[tuple[str, ...], PluginKind, bool], ...] = (
    (("actor", "engine"), TRAIN_ENGINE, False),
    *(((role, "engine"), TRAIN_ENGINE, False) for role in OPTIONAL_ROLES),
    (("rollout", "engine"), ROLLOUT_ENGINE, False),
    (("rollout", "workflow"), WORKFLOW, False),
    (("algorithm", "advantage"), ADVANTAGE, False),
    (("algorithm", "loss"), POLICY_LOSS, False),
    (("algorithm", "filters"), SAMPLE_FILTER, True),
    (("algorithm", "rejection_sampling"), REJECTION_SAMPLER, False),
    (("reward",), REWARD, False),
    (("loggers",), LOGGER, True),
    (("trainer", "loop"), LOOP, False),
)


def _get(data: Any, path: Sequence[Any]) -> Any:
    """The node at ``path`` in plain data, or ``None``."""
    node = data
    for key in path:
        if isinstance(node, Mapping):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
    return node


def _plugin_sections(data: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], PluginKind]]:
    """The plugin sections present in unstructured ``data``: ``(path, kind)``."""
    for keys, kind, is_list in _RAW_SPEC_PATHS:
        node = _get(data, keys)
        if node is None:
            continue
        if is_list and isinstance(node, list):
            for i in range(len(node)):
                yield (*keys, i), kind
        elif not is_list:
            yield keys, kind


def _is_plugin_section(path: tuple[Any, ...]) -> bool:
    for keys, _kind, is_list in _RAW_SPEC_PATHS:
        if path[: len(keys)] == keys and len(path) == len(keys) + (1 if is_list else 0):
            return not is_list or isinstance(path[-1], int)
    return False


def _raw_plugin_problems(data: Mapping[str, Any], host: PluginHost) -> list[str]:
    """Validate the plugin sections found in unstructured ``data`` (used when the rest failed)."""
    problems: list[str] = []
    for path, kind in _plugin_sections(data):
        try:
            spec = _structure_plugin_spec(_get(data, path), PluginSpec)
            validate_plugin_section(host, kind, spec, format_path(path))
        except ConfigError as exc:
            problems.extend(exc.problems)
        except (TypeMismatch, FieldValueError):
            pass  # already reported by the main pass
    return problems


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


def loop_roles(cfg: RunConfig, host: PluginHost | None = None) -> tuple[str, ...] | None:
    """The optional role sections (:data:`core_rl.roles.OPTIONAL_ROLES`) the selected loop reads:
    its config class's ``roles`` attribute, else all of them for a loop that uses the RL sections
    and none for one that does not. ``None`` when the loop is unknown (reported already)."""
    from core_rl.roles import OPTIONAL_ROLES

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
    from core_rl.roles import role_sections

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


def _completeness_problems(cfg: RunConfig, host: PluginHost | None = None) -> list[str]:
    problems = []
    if not cfg.actor.model_path:
        problems.append("actor.model_path: required; the path of a Hugging Face model directory")
    problems.extend(_unused_role_problems(cfg, host))
    if uses_rl_sections(cfg, host):
        problems.extend(_rl_completeness_problems(cfg))
    if not cfg.data.train_files:
        problems.append("data.train_files: required; a list of JSON/JSONL/Parquet files of prompts")
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


def _weight_sync_problems(host: PluginHost, cfg: RunConfig) -> list[str]:
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


def _cross_section_problems(cfg: RunConfig) -> list[str]:
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
    late = [s for s in cfg.trainer.profile.steps if s > cfg.trainer.total_steps]
    if late:
        problems.append(
            f"trainer.profile.steps: {late} {'is' if len(late) == 1 else 'are'} after the last step "
            f"(trainer.total_steps={cfg.trainer.total_steps}); list steps from 1 to {cfg.trainer.total_steps}"
        )
    if cfg.algorithm.ppo_n_minibatches > samples:
        problems.append(
            f"algorithm.ppo_n_minibatches: must be <= the samples of a step, data.batch_size x rollout.sampling.n "
            f"= {samples}, got {cfg.algorithm.ppo_n_minibatches}"
        )
    return problems


def _plugin_check_problems(cfg: RunConfig) -> list[str]:
    """Each validated plugin section's own ``check_config`` (see :mod:`core_rl.config.checks`)."""
    problems: list[str] = []
    for path, _kind, spec in selected_sections(cfg):
        if spec.config is not None:
            problems.extend(config_problems(spec.config, SectionContext(path=path, run=cfg, name=spec.name)))
    return problems


def _drop_replaced_sections(defaults: dict[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """Remove from recipe ``defaults`` each plugin section the user points at another plugin, so
    the recipe's options for its own choice do not leak into the user's (a list section given by
    the user replaces the recipe's anyway)."""
    for keys, _kind, is_list in _RAW_SPEC_PATHS:
        if is_list:
            continue
        parent = _get(defaults, keys[:-1])
        if not isinstance(parent, dict) or keys[-1] not in parent:
            continue
        theirs = _section_name(_get(user, keys))
        if theirs is not None and theirs != _section_name(parent[keys[-1]]):
            del parent[keys[-1]]
    return defaults


def _section_name(node: Any) -> Any:
    return node.get("name") if isinstance(node, Mapping) else node


def _merge_under(base: Any, top: Any) -> Any:
    """``top`` over ``base``: mappings merge key by key, anything else in ``top`` replaces."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for key, value in top.items():
            out[key] = _merge_under(base[key], value) if key in base else value
        return out
    return top


def _from_command_line(path: tuple[Any, ...], touched: Sequence[tuple[Any, ...]]) -> bool:
    """Whether an override set ``path``, a section containing it, or a key below it."""
    return any(t == path[: len(t)] or path == t[: len(path)] for t in touched)


Notify = Callable[[str], None]


def _drop_foreign_options(
    before: Mapping[str, Any],
    data: dict[str, Any],
    touched: Sequence[tuple[Any, ...]],
    host: PluginHost,
    source: str,
    notify: Notify,
) -> None:
    """Where an override switched a plugin section to another plugin, drop the options that came
    from the file and that the new plugin does not take (and say so through ``notify``)."""
    for path, kind in list(_plugin_sections(data)):
        new, old = _section_name(_get(data, path)), _section_name(_get(before, path))
        section = _get(data, path)
        if not isinstance(new, str) or not isinstance(old, str) or new == old or not isinstance(section, dict):
            continue
        try:
            entry = host.get(kind, new)
        except PluginError:
            continue  # reported when the section is validated
        known = {a.name for a in attrs.fields(entry.config_cls)} if entry.config_cls is not None else set()
        dropped = [
            key
            for key in section
            if key != "name" and key not in known and not _from_command_line((*path, key), touched)
        ]
        for key in dropped:
            del section[key]
        if dropped:
            notify(
                f"{format_path(path)}.name is {new!r} (was {old!r} in {source}): dropped "
                f"{', '.join(map(str, dropped))} from the file, which {kind.label} {new!r} does not take"
            )


def read_yaml(path: str | Path) -> DictConfig:
    """Parse a YAML file into an OmegaConf mapping; a missing file or bad YAML is a ConfigError
    naming the file and the 1-based line and column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        loaded = OmegaConf.load(p)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError([f"{where}: cannot parse YAML: {what}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"]) from None
    except Exception as exc:  # yaml.YAMLError without a position, OmegaConf's own (e.g. a null key)
        msg = first_line(exc)
        raise ConfigError([f"cannot parse YAML: {msg}"], source=str(p)) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(["the top level must be a mapping"], source=str(p))
    return loaded


def _resolve_algorithm_name(data: dict[str, Any], source: str | None) -> Any:
    name = _get(data, ("algorithm", "name"))
    if not isinstance(name, str) or "${" not in name:
        return name
    try:
        return OmegaConf.select(OmegaConf.create(data), "algorithm.name", default=None)
    except OmegaConfBaseException as exc:
        msg = first_line(exc)
        raise ConfigError([f"algorithm.name: {msg}"], source=source) from None


def _stderr_note(message: str) -> None:
    print(f"core-rl: note: {message}", file=sys.stderr)


def merge_raw(
    path: str | Path | None,
    overrides: Sequence[str],
    host: PluginHost,
    *,
    notify: Notify | None = None,
) -> dict[str, Any]:
    """YAML + overrides + the selected algorithm's defaults, interpolations resolved, as plain data.

    ``notify`` receives notes on what the overrides changed beyond their own keys (options
    dropped by a plugin switch); default: print them to stderr.
    """
    notify = notify or _stderr_note
    source = str(path) if path is not None else None
    base = read_yaml(path) if path is not None else OmegaConf.create({})
    try:
        data = OmegaConf.to_container(base, resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot read the configuration: {exc}"], source=source) from None
    assert isinstance(data, dict)
    parsed = parse_overrides(overrides)
    before = copy.deepcopy(data)
    touched = apply_overrides(data, parsed, expand_name=_is_plugin_section)
    _drop_foreign_options(before, data, touched, host, source or "the defaults", notify)

    algorithm = _resolve_algorithm_name(data, source)
    if algorithm:
        if not isinstance(algorithm, str):
            raise ConfigError([f"algorithm.name: expected a string, got {algorithm!r}"], source=source)
        try:
            recipe = build_component(host.get(ALGORITHM, algorithm))
        except PluginError as exc:
            raise ConfigError([f"algorithm.name: {exc}"], source=source) from None
        defaults = _drop_replaced_sections(copy.deepcopy(dict(recipe.defaults)), data)
        data = _merge_under(defaults, data)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "<root>"
        msg = first_line(exc)
        raise ConfigError([f"{key}: cannot resolve interpolation: {msg}"], source=source) from None
    assert isinstance(resolved, dict)
    return resolved


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    host: PluginHost,
    require_complete: bool = True,
    notify: Notify | None = None,
) -> RunConfig:
    """Load, merge, resolve and validate a run configuration (see the module docstring).

    ``require_complete``: also require what a training run needs (model path, algorithm, reward,
    data). ``notify``: see :func:`merge_raw`. Raises :class:`ConfigError` listing every problem
    found.
    """
    source = str(path) if path is not None else None
    data = merge_raw(path, overrides, host, notify=notify)
    try:
        cfg: RunConfig = structure(data, RunConfig)
    except ConfigError as exc:
        # report problems in the plugin sections too, not only the first layer's
        raise ConfigError(exc.problems + _raw_plugin_problems(data, host), source=source) from None
    problems: list[str] = []
    for spec_path, kind, spec in selected_sections(cfg):
        try:
            validate_plugin_section(host, kind, spec, spec_path, run=cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    problems.extend(_weight_sync_problems(host, cfg))
    if cfg.actor.lr_scheduler.total_steps == 0:
        cfg.actor.lr_scheduler.total_steps = cfg.trainer.total_steps * cfg.algorithm.optimizer_steps_per_step
    if cfg.critic is not None and cfg.critic.lr_scheduler.total_steps == 0:
        cfg.critic.lr_scheduler.total_steps = cfg.trainer.total_steps * cfg.algorithm.optimizer_steps_per_step
    problems.extend(_cross_section_problems(cfg))
    problems.extend(_plugin_check_problems(cfg))
    if require_complete:
        problems.extend(_completeness_problems(cfg, host))
        from core_rl.roles import role_problems  # roles imports the schema: import it late

        problems.extend(role_problems(cfg, host))
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved configuration as plain data (plugin sections with their defaults)."""
    return CONVERTER.unstructure(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg)))
