"""Load a run configuration: YAML + dotted overrides (OmegaConf: parsing, merging, ``${...}``
interpolation), algorithm recipe defaults, typed structuring and validation (cattrs into
:mod:`core_rl.config.schema`), then each selected plugin's own section.

Every problem is reported with its key path, e.g. ``actor.optimizer.lr: must be > 0, got -1.0`` or
``actor.optimzer: unknown key; did you mean 'optimizer'?``.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.config.validators import FieldValueError
from core_rl.errors import ConfigError, PluginError
from core_rl.kinds import (
    ADVANTAGE,
    ALGORITHM,
    LOGGER,
    POLICY_LOSS,
    REWARD,
    ROLLOUT_ENGINE,
    SAMPLE_FILTER,
    TRAIN_ENGINE,
    PluginKind,
)
from core_rl.plugins import PluginHost


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
    if isinstance(value, bool):
        raise TypeMismatch("a number", value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 as a string
        try:
            return float(value)
        except ValueError:
            pass
    raise TypeMismatch("a number", value)


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


def _is_list_type(t: Any) -> bool:
    return getattr(t, "__origin__", None) is list


def _list_hook_factory(conv: cattrs.Converter) -> Any:
    """Structure ``list[X]`` from a list or tuple only (cattrs would split a string into characters),
    reporting each bad item with its index."""

    def factory(t: Any) -> Any:
        item_type = t.__args__[0] if getattr(t, "__args__", None) else Any

        def structure_list(value: Any, _t: Any) -> list[Any]:
            if not isinstance(value, (list, tuple)):
                raise TypeMismatch("a list", value)
            out, errors = [], []
            for i, item in enumerate(value):
                try:
                    out.append(conv.structure(item, item_type))
                except Exception as exc:
                    exc.add_note(IterableValidationNote(f"Structuring {t} @ index {i}", i, item_type))
                    errors.append(exc)
            if errors:
                raise IterableValidationError(f"While structuring {t}", errors, t)
            return out

        return structure_list

    return factory


def make_converter() -> cattrs.Converter:
    """The converter used for every config class: unknown keys are errors, scalars are type-checked."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(PluginSpec, _structure_plugin_spec)
    conv.register_structure_hook_factory(_is_list_type, _list_hook_factory(conv))
    conv.register_unstructure_hook(PluginSpec, lambda spec: unstructure_spec(conv, spec))
    return conv


def unstructure_spec(conv: cattrs.Converter, spec: PluginSpec) -> dict[str, Any]:
    options = conv.unstructure(spec.config) if spec.config is not None else dict(spec.options)
    return {"name": spec.name, **options}


CONVERTER = make_converter()


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _describe(exc: BaseException, path: str) -> Iterator[str]:
    """Flatten a cattrs validation error tree into one message per problem."""
    if isinstance(exc, ForbiddenExtraKeysError):
        valid = [a.name for a in attrs.fields(exc.cl)]
        for key in sorted(exc.extra_fields):
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
            yield f"{_join(path, key)}: unknown key{hint}"
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
        yield f"{path}: expected {exc.expected}, got {exc.value!r}"
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
    except (ClassValidationError, IterableValidationError, FieldValueError, TypeMismatch) as exc:
        raise ConfigError(list(_describe(exc, path))) from None


def _selected_specs(cfg: RunConfig) -> Iterator[tuple[str, PluginKind, PluginSpec]]:
    yield "actor.engine", TRAIN_ENGINE, cfg.actor.engine
    yield "rollout.engine", ROLLOUT_ENGINE, cfg.rollout.engine
    if cfg.algorithm.advantage is not None:
        yield "algorithm.advantage", ADVANTAGE, cfg.algorithm.advantage
    if cfg.algorithm.loss is not None:
        yield "algorithm.loss", POLICY_LOSS, cfg.algorithm.loss
    for i, spec in enumerate(cfg.algorithm.filters):
        yield f"algorithm.filters[{i}]", SAMPLE_FILTER, spec
    if cfg.reward is not None:
        yield "reward", REWARD, cfg.reward
    for i, spec in enumerate(cfg.loggers):
        yield f"loggers[{i}]", LOGGER, spec


def validate_plugin_section(host: PluginHost, kind: PluginKind, spec: PluginSpec, path: str) -> None:
    """Resolve ``spec.name`` in ``kind``'s registry and validate its options by the plugin's class."""
    try:
        entry = host.get(kind, spec.name)
    except PluginError as exc:
        raise ConfigError([f"{path}.name: {exc}"]) from None
    if entry.config_cls is None:
        if spec.options:
            raise ConfigError(
                [f"{path}: {kind.label} {spec.name!r} takes no options, got {', '.join(sorted(spec.options))}"]
            )
        return
    spec.config = structure(spec.options, entry.config_cls, path=path)


_RAW_SPEC_PATHS: tuple[tuple[tuple[str, ...], PluginKind, bool], ...] = (
    (("actor", "engine"), TRAIN_ENGINE, False),
    (("rollout", "engine"), ROLLOUT_ENGINE, False),
    (("algorithm", "advantage"), ADVANTAGE, False),
    (("algorithm", "loss"), POLICY_LOSS, False),
    (("algorithm", "filters"), SAMPLE_FILTER, True),
    (("reward",), REWARD, False),
    (("loggers",), LOGGER, True),
)


def _raw_plugin_problems(data: Mapping[str, Any], host: PluginHost) -> list[str]:
    """Validate the plugin sections found in unstructured ``data`` (used when the rest failed)."""
    problems: list[str] = []
    for keys, kind, is_list in _RAW_SPEC_PATHS:
        node: Any = data
        for key in keys:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is None:
            continue
        path = ".".join(keys)
        items = (
            [(f"{path}[{i}]", v) for i, v in enumerate(node)] if is_list and isinstance(node, list) else [(path, node)]
        )
        for item_path, raw in items:
            try:
                validate_plugin_section(host, kind, _structure_plugin_spec(raw, PluginSpec), item_path)
            except ConfigError as exc:
                problems.extend(exc.problems)
            except (TypeMismatch, FieldValueError):
                pass  # already reported by the main pass
    return problems


def _completeness_problems(cfg: RunConfig) -> list[str]:
    problems = []
    if not cfg.actor.model_path:
        problems.append("actor.model_path: required; the path of a Hugging Face model directory")
    if not cfg.algorithm.name and (cfg.algorithm.advantage is None or cfg.algorithm.loss is None):
        problems.append("algorithm.name: required (e.g. grpo), or set both algorithm.advantage and algorithm.loss")
    else:
        if cfg.algorithm.advantage is None:
            problems.append(
                f"algorithm.advantage: algorithm {cfg.algorithm.name!r} sets no advantage estimator; set one"
            )
        if cfg.algorithm.loss is None:
            problems.append(f"algorithm.loss: algorithm {cfg.algorithm.name!r} sets no policy loss; set one")
    if cfg.reward is None:
        problems.append("reward: required; select a reward, e.g. reward: {name: exact_match}")
    if not cfg.data.train_files:
        problems.append("data.train_files: required; a list of JSON/JSONL/Parquet files of prompts")
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


def _drop_replaced_sections(defaults: dict[str, Any], user: DictConfig) -> dict[str, Any]:
    """Remove from recipe ``defaults`` each plugin section the user points at another plugin, so
    the recipe's options for its own choice do not leak into the user's (a list section given by
    the user replaces the recipe's anyway)."""
    for keys, _kind, is_list in _RAW_SPEC_PATHS:
        if is_list:
            continue
        parent: Any = defaults
        for key in keys[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or keys[-1] not in parent:
            continue
        ours = parent[keys[-1]]
        ours_name = ours.get("name") if isinstance(ours, dict) else ours
        theirs = OmegaConf.select(user, ".".join(keys), default=None)
        theirs_name = theirs.get("name") if isinstance(theirs, DictConfig) else theirs
        if theirs_name is not None and theirs_name != ours_name:
            del parent[keys[-1]]
    return defaults


def read_yaml(path: str | Path) -> DictConfig:
    """Parse a YAML file into an OmegaConf mapping; a missing file or bad YAML is a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        loaded = OmegaConf.load(p)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own
        raise ConfigError([f"cannot parse YAML: {exc}"], source=str(p)) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(["the top level must be a mapping"], source=str(p))
    return loaded


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``["actor.optimizer.lr=1e-5", ...]`` -> an OmegaConf mapping; values are parsed as YAML."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"override {item!r} must look like key.path=value"])
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot parse overrides: {exc}"]) from None


def merge_raw(path: str | Path | None, overrides: Sequence[str], host: PluginHost) -> dict[str, Any]:
    """YAML + overrides + the selected algorithm's defaults, interpolations resolved, as plain data."""
    base = read_yaml(path) if path is not None else OmegaConf.create({})
    source = str(path) if path is not None else None
    try:
        merged = OmegaConf.merge(base, parse_overrides(overrides))
        algorithm = OmegaConf.select(merged, "algorithm.name", default=None)
    except OmegaConfBaseException as exc:
        raise ConfigError(
            [f"{getattr(exc, 'full_key', '') or '<root>'}: {exc.msg if hasattr(exc, 'msg') else exc}"], source=source
        ) from None
    if algorithm:
        if not isinstance(algorithm, str):
            raise ConfigError([f"algorithm.name: expected a string, got {algorithm!r}"], source=source)
        try:
            recipe = host.get(ALGORITHM, algorithm).factory()
        except PluginError as exc:
            raise ConfigError([f"algorithm.name: {exc}"], source=source) from None
        defaults = _drop_replaced_sections(copy.deepcopy(dict(recipe.defaults)), merged)
        merged = OmegaConf.merge(OmegaConf.create(defaults), merged)
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "<root>"
        msg = getattr(exc, "msg", None) or str(exc).splitlines()[0]
        raise ConfigError([f"{key}: cannot resolve interpolation: {msg}"], source=source) from None
    assert isinstance(data, dict)
    return data


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    host: PluginHost,
    require_complete: bool = True,
) -> RunConfig:
    """Load, merge, resolve and validate a run configuration (see the module docstring).

    ``require_complete``: also require what a training run needs (model path, algorithm, reward,
    data). Raises :class:`ConfigError` listing every problem found.
    """
    source = str(path) if path is not None else None
    data = merge_raw(path, overrides, host)
    try:
        cfg: RunConfig = structure(data, RunConfig)
    except ConfigError as exc:
        # report problems in the plugin sections too, not only the first layer's
        raise ConfigError(exc.problems + _raw_plugin_problems(data, host), source=source) from None
    problems: list[str] = []
    for spec_path, kind, spec in _selected_specs(cfg):
        try:
            validate_plugin_section(host, kind, spec, spec_path)
        except ConfigError as exc:
            problems.extend(exc.problems)
    problems.extend(_weight_sync_problems(host, cfg))
    if cfg.actor.lr_scheduler.total_steps == 0:
        cfg.actor.lr_scheduler.total_steps = cfg.trainer.total_steps
    if require_complete:
        problems.extend(_completeness_problems(cfg))
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved configuration as plain data (plugin sections with their defaults)."""
    return CONVERTER.unstructure(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg)))
