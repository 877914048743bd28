"""Load a run configuration, in this order:

1. the YAML file (OmegaConf), kept unresolved;
2. command-line overrides (:mod:`core_rl.config.overrides`); where one switches a plugin section to
   another plugin (``reward.name=...``), the options that came from the file and that the new
   plugin does not take are dropped, with a note;
3. the selected algorithm's recipe defaults, merged under the result (a section the user points
   at another plugin replaces the recipe's);
4. ``${...}`` interpolation (OmegaConf); a ``model_path`` / ``tokenizer_path`` naming a ``.gguf``
   file becomes the Hugging Face directory converted from it (:mod:`core_rl.gguf`, cached);
5. typed structuring and validation (cattrs into :mod:`core_rl.config.schema`,
   :mod:`core_rl.config.converter`), then each selected plugin's own section by its
   ``config_cls`` (:mod:`core_rl.config.sections`), the keys derived from others
   (:mod:`core_rl.config.derived`), then checks across sections (:mod:`core_rl.config.problems`,
   and each plugin's ``check_config``, :mod:`core_rl.config.checks`).

Every problem of the whole configuration is reported at once, each with its key path, e.g.
``actor.optimizer.lr: must be in (0, 10], got 50.0`` or ``actor.optimzer: unknown key; did you mean
'optimizer'?``. :func:`to_yaml` writes a configuration back as YAML that loads to the same one.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_rl import gguf
from core_rl.components import build_component
from core_rl.config.converter import CONVERTER, TypeMismatch, make_converter, structure
from core_rl.config.derived import INTERPOLATION, derive_schedules, interpolations, record
from core_rl.config.epochs import defer_total_steps
from core_rl.config.optimizer_checks import optimizer_problems
from core_rl.config.overrides import apply_overrides, first_line, format_path, parse_overrides
from core_rl.config.paths import node_at, replace_at
from core_rl.config.problems import (
    completeness_problems,
    cross_section_problems,
    engine_releases_memory,
    eval_problems,
    keep_best_problems,
    loop_roles,
    plugin_check_problems,
    sampling_extra_problems,
    uses_rl_sections,
    weight_sync_problems,
)
from core_rl.config.schema import RunConfig
from core_rl.config.sections import (
    RAW_SPEC_PATHS,
    is_plugin_section,
    raw_plugin_problems,
    raw_plugin_sections,
    selected_sections,
    validate_plugin_section,
)
from core_rl.errors import ConfigError, PluginError
from core_rl.freezing import engine_problems as freeze_engine_problems
from core_rl.kinds import ALGORITHM
from core_rl.lora_sync import problems as lora_sync_problems
from core_rl.placement import placement_config_problems, sleep_problems
from core_rl.plugins import PluginHost
from core_rl.remote_code import engine_problems as remote_code_engine_problems
from core_rl.roles import role_problems

__all__ = [  # what this module has long offered, wherever it now lives
    "CONVERTER",
    "TypeMismatch",
    "load_config",
    "loop_roles",
    "make_converter",
    "merge_raw",
    "read_yaml",
    "selected_sections",
    "structure",
    "to_plain",
    "to_yaml",
    "uses_rl_sections",
    "validate_plugin_section",
]


def _drop_replaced_sections(defaults: dict[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """Remove from recipe ``defaults`` each plugin section the user points at another plugin, so
    the recipe's options for its own choice do not leak into the user's (a list section given by
    the user replaces the recipe's anyway)."""
    for keys, _kind, is_list in RAW_SPEC_PATHS:
        if is_list:
            continue
        parent = node_at(defaults, keys[:-1])
        if not isinstance(parent, dict) or keys[-1] not in parent:
            continue
        theirs = _section_name(node_at(user, keys))
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
    for path, kind in list(raw_plugin_sections(data)):
        new, old = _section_name(node_at(data, path)), _section_name(node_at(before, path))
        section = node_at(data, path)
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
    name = node_at(data, ("algorithm", "name"))
    if not isinstance(name, str) or "${" not in name:
        return name
    try:
        return OmegaConf.select(OmegaConf.create(data), "algorithm.name", default=None)
    except OmegaConfBaseException as exc:
        msg = first_line(exc)
        raise ConfigError([f"algorithm.name: {msg}"], source=source) from None


def _stderr_note(message: str) -> None:
    print(f"core-rl: note: {message}", file=sys.stderr)


def _merged(path: str | Path | None, overrides: Sequence[str], host: PluginHost, notify: Notify) -> dict[str, Any]:
    """YAML + overrides + the selected algorithm's defaults, as plain data, unresolved."""
    source = str(path) if path is not None else None
    base = read_yaml(path) if path is not None else OmegaConf.create({})
    try:
        data = OmegaConf.to_container(base, resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot read the configuration: {exc}"], source=source) from None
    assert isinstance(data, dict)
    parsed = parse_overrides(overrides)
    before = copy.deepcopy(data)
    touched = apply_overrides(data, parsed, expand_name=is_plugin_section)
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
    return data


def _resolved(data: dict[str, Any], source: str | None) -> dict[str, Any]:
    """``data`` with its ``${...}`` interpolations resolved."""
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "<root>"
        msg = first_line(exc)
        raise ConfigError([f"{key}: cannot resolve interpolation: {msg}"], source=source) from None
    assert isinstance(resolved, dict)
    return resolved


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
    source = str(path) if path is not None else None
    return _resolved(_merged(path, overrides, host, notify or _stderr_note), source)


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
    found. The keys derived from others (:mod:`core_rl.config.derived`) are filled in and
    recorded in ``derived`` of the result.
    """
    source = str(path) if path is not None else None
    unresolved = _merged(path, overrides, host, notify or _stderr_note)
    data = _resolved(unresolved, source)
    gguf_problems = gguf.resolve_model_paths(data, notify or _stderr_note)  # a .gguf file -> its HF directory
    if gguf_problems:
        raise ConfigError(gguf_problems, source=source)
    try:
        cfg: RunConfig = structure(data, RunConfig)
    except ConfigError as exc:
        # report problems in the plugin sections too, not only the first layer's
        raise ConfigError(exc.problems + raw_plugin_problems(data, host), source=source) from None
    for interpolated in interpolations(unresolved, data):
        record(cfg, interpolated)
    problems: list[str] = []
    for spec_path, kind, spec in selected_sections(cfg):
        try:
            validate_plugin_section(host, kind, spec, spec_path, run=cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    problems.extend(weight_sync_problems(host, cfg))
    problems.extend(sampling_extra_problems(host, cfg))
    problems.extend(lora_sync_problems(cfg, host))
    problems.extend(defer_total_steps(cfg, data))  # trainer.total_epochs: total_steps derived at the start
    derive_schedules(cfg)
    problems.extend(cross_section_problems(cfg))
    problems.extend(optimizer_problems(cfg))
    problems.extend(eval_problems(cfg, host))
    problems.extend(keep_best_problems(cfg, host))
    problems.extend(plugin_check_problems(cfg))
    problems.extend(placement_config_problems(cfg))
    problems.extend(sleep_problems(cfg, releases_memory=engine_releases_memory(host, cfg) is not False))
    if require_complete:
        problems.extend(completeness_problems(cfg, host))
        problems.extend(role_problems(cfg, host))
        problems.extend(remote_code_engine_problems(cfg, host))
        problems.extend(freeze_engine_problems(cfg, host))
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved configuration as plain data (plugin sections with their defaults; the
    derived keys with their values)."""
    return CONVERTER.unstructure(cfg)


_MARK = "core-rl-derived-{}-8c1f"


def _yaml_scalar(value: Any) -> str:
    """``value`` as a one-line YAML scalar."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()


def to_yaml(cfg: RunConfig) -> str:
    """The configuration as YAML, as ``core-rl config show`` prints it and ``<run>/config.yaml``
    records it: every key with its value, except each key derived from others
    (:mod:`core_rl.config.derived`), written as what keeps it derived with its value in a comment
    (``total_steps: 0  # derived: 20 = trainer.total_steps x ...``). Loading it gives ``cfg`` again."""
    data = json.loads(json.dumps(to_plain(cfg)))  # a copy, tuples as lists (as YAML gives them back)
    lines: dict[str, str] = {}
    for i, derived in enumerate(cfg.derived.values()):
        mark = _MARK.format(i)
        if replace_at(data, derived.path, mark):
            if derived.value is None and derived.at_start:  # to be chosen when the run starts
                lines[mark] = f"{_yaml_scalar(derived.written)}  # derived: {derived.source}"
                continue
            how = "" if derived.source == INTERPOLATION else f" = {derived.source}"
            lines[mark] = f"{_yaml_scalar(derived.written)}  # derived: {json.dumps(derived.value)}{how}"
    text = OmegaConf.to_yaml(OmegaConf.create(data))
    for mark, line in lines.items():
        text = text.replace(mark, line, 1)
    return text
