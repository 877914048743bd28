"""Load a run configuration, in this order:

1. the YAML file (OmegaConf), kept unresolved;
2. command-line overrides (:mod:`core_rl.config.overrides`); where one switches a plugin section to
   another plugin (``reward.name=...``, or ``algorithm.name=...`` selecting a recipe with another
   ``trainer.loop``), the options that came from the file and that the new plugin does not take
   are dropped, with a note;
3. the selected algorithm's recipe defaults, merged under the result (a section the user points
   at another plugin replaces the recipe's; where the user sets a key that a recipe value
   depends on, :attr:`~core_rl.interfaces.AlgorithmRecipe.depends_on`, to another value, that
   recipe value is left out, with a note); a plugin section left without a ``name`` takes its
   default one (``trainer.loop``: ``rl``);
4. ``${...}`` interpolation (OmegaConf); every ``model_path`` / ``tokenizer_path`` is offered to
   the installed model sources, and one a source claims becomes the local Hugging Face directory
   it returns (:mod:`core_rl.roles.model_sources`; e.g. a ``.gguf`` file, converted once and
   cached by core-rl-gguf);
5. typed structuring and validation (cattrs into :mod:`core_rl.config.schema`,
   :mod:`core_rl.config.converter`), then each selected plugin's own section by its
   ``config_cls`` (:mod:`core_rl.config.sections`), the keys derived from others
   (:mod:`core_rl.config.derived`), then checks across sections (:mod:`core_rl.config.problems`,
   and each plugin's ``check_config``, :mod:`core_rl.config.checks`).

Every problem of the whole configuration is reported at once, each with its key path, e.g.
``actor.optimizer.lr: must be in (0, 10], got 50.0`` or ``actor.optimzer: unknown key; did you mean
'optimizer'?``, and with where each value it names was set (:mod:`core_rl.config.provenance`: a
line of the file, an override, the recipe's defaults). :func:`to_yaml` writes a configuration back
as YAML that loads to the same one; :func:`marked_yaml` writes a merged configuration that is not
valid, its problems marked where they are.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_rl.config.converter import CONVERTER, TypeMismatch, make_converter, structure
from core_rl.config.derived import INTERPOLATION, derive_schedules, interpolations, record
from core_rl.config.epochs import defer_total_steps
from core_rl.config.optimizer_checks import optimizer_problems
from core_rl.config.overrides import apply_overrides, first_line, format_path, parse_overrides
from core_rl.config.paths import Path as KeyPath
from core_rl.config.paths import is_set, node_at, parse_key, replace_at
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
from core_rl.config.provenance import (
    Provenance,
    Source,
    file_source,
    override_source,
    recipe_source,
    yaml_lines,
)
from core_rl.config.routing_replay import routing_replay_problems
from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.config.sections import (
    RAW_SPEC_PATHS,
    is_plugin_section,
    raw_plugin_problems,
    raw_plugin_sections,
    selected_sections,
    validate_plugin_section,
)
from core_rl.data.sources import source_entry_problems
from core_rl.errors import ConfigError, PluginError, stderr_line
from core_rl.interfaces import AlgorithmRecipe
from core_rl.launch.placement import placement_config_problems, sleep_problems
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM
from core_rl.roles.build import role_problems
from core_rl.roles.freezing import engine_problems as freeze_engine_problems
from core_rl.roles.model_sources import resolve_model_paths
from core_rl.roles.remote_code import engine_problems as remote_code_engine_problems
from core_rl.sync.lora import problems as lora_sync_problems
from core_rl.vision.engines import engine_problems as multimodal_engine_problems

__all__ = [  # what this module has long offered, wherever it now lives
    "CONVERTER",
    "MergedConfig",
    "TypeMismatch",
    "load_config",
    "loop_roles",
    "make_converter",
    "marked_yaml",
    "merge_config",
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
    """``top`` over ``base``: mappings merge key by key (``top``'s keys first, in its order, then
    the rest of ``base``'s), anything else in ``top`` replaces."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = {key: _merge_under(base[key], value) if key in base else value for key, value in top.items()}
        out.update((key, value) for key, value in base.items() if key not in top)
        return out
    return top


def _from_command_line(path: tuple[Any, ...], touched: Sequence[tuple[Any, ...]]) -> bool:
    """Whether an override set ``path``, a section containing it, or a key below it."""
    return any(t == path[: len(t)] or path == t[: len(path)] for t in touched)


Notify = Callable[[str], None]


@functools.cache
def _schema_defaults() -> RunConfig:
    return RunConfig()


def _default_plugin_name(path: KeyPath) -> str | None:
    """The name the plugin section at ``path`` has when nothing names it (the schema's default:
    ``trainer.loop`` ``rl``, ``rollout.engine`` ``hf``, ...); ``None`` for a list item or a
    section without one."""
    node: Any = _schema_defaults()
    for key in path:
        if isinstance(key, int) or node is None:
            return None
        node = getattr(node, key, None)
    return node.name if isinstance(node, PluginSpec) else None


def _chosen_name(user: Mapping[str, Any], defaults: Mapping[str, Any], path: KeyPath) -> Any:
    """The plugin the section at ``path`` selects: the user's name, else the recipe's, else the
    schema's default."""
    for layer in (user, defaults):
        name = _section_name(node_at(layer, path))
        if name is not None:
            return name
    return _default_plugin_name(path)


def _fill_default_names(data: dict[str, Any]) -> None:
    """Give each plugin section that holds options but no ``name`` its default name (the schema's),
    so ``trainer: {loop: {beta: 0.1}}`` under an RL recipe is the ``rl`` loop with an unknown key
    rather than a loop without a name."""
    for path, _kind in list(raw_plugin_sections(data)):
        section = node_at(data, path)
        default = _default_plugin_name(path)
        if isinstance(section, dict) and "name" not in section and default is not None:
            section["name"] = default


@attrs.frozen
class _RecipeChoice:
    """An ``algorithm.name`` and its recipe's defaults (empty for none, or one that cannot load)."""

    name: str | None
    defaults: Mapping[str, Any]


def _drop_foreign_options(
    before: Mapping[str, Any],
    data: dict[str, Any],
    recipes: tuple[_RecipeChoice, _RecipeChoice],
    touched: Sequence[tuple[Any, ...]],
    host: PluginHost,
    source: str,
    notify: Notify,
) -> None:
    """Where the overrides switched a plugin section to another plugin (its own ``name``, or an
    ``algorithm.name`` whose recipe selects another, such as another ``trainer.loop``), drop the
    options that came from the file and that the new plugin does not take (and say so through
    ``notify``). ``recipes``: the algorithm recipe before the overrides and after."""
    old_recipe, new_recipe = recipes
    for path, kind in list(raw_plugin_sections(data)):
        section = node_at(data, path)
        if not isinstance(section, dict):
            continue
        old = _chosen_name(before, old_recipe.defaults, path)
        new = _chosen_name(data, new_recipe.defaults, path)
        if not isinstance(new, str) or not isinstance(old, str) or new == old:
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
        if not dropped:
            continue
        if _section_name(node_at(data, path)) not in (None, _section_name(node_at(before, path))):
            was = f"was {old!r} in {source}"
        else:
            algorithms = f"algorithm.name {old_recipe.name!r} in {source}; algorithm.name is {new_recipe.name!r}"
            was = f"was {old!r} with {algorithms}"
        notify(
            f"{format_path(path)}.name is {new!r} ({was}): dropped {', '.join(map(str, dropped))} from the file, "
            f"which {kind.label} {new!r} does not take"
        )


def _yaml_value(value: Any) -> str:
    return _yaml_scalar(value) if not isinstance(value, (Mapping, list)) else json.dumps(value)


def _yield_dependent_defaults(
    defaults: dict[str, Any],
    data: Mapping[str, Any],
    recipe: AlgorithmRecipe,
    name: str,
    provenance: Provenance,
    notify: Notify,
) -> None:
    """Leave out of the recipe's ``defaults`` (changed in place) each value of
    :attr:`~core_rl.interfaces.AlgorithmRecipe.depends_on` that the user left unset where the user
    set a key it depends on to a value other than the recipe's; say so through ``notify``."""
    for dependent, bases in recipe.depends_on.items():
        target = parse_key(dependent)
        if is_set(data, target) or not is_set(defaults, target):
            continue
        changed = [path for path in map(parse_key, bases) if is_set(data, path)]
        changed = [path for path in changed if node_at(data, path) != node_at(defaults, path)]
        if not changed:
            continue
        value = node_at(defaults, target)
        del node_at(defaults, target[:-1])[target[-1]]
        users = "; ".join(
            f"{format_path(path)} is {_yaml_value(node_at(data, path))} ({provenance.source(path).where})"
            + (f", not the {name!r} recipe's {_yaml_value(node_at(defaults, path))}" if is_set(defaults, path) else "")
            for path in changed
        )
        notify(
            f"{users}; so the recipe's {dependent}: {_yaml_value(value)}, chosen for its own value, is "
            f"not applied (the section's own default applies); set {dependent} to choose another value"
        )


def _user_sources(
    source: str | None, lines: Mapping[KeyPath, int], overrides: Sequence[tuple[KeyPath, str]]
) -> Callable[[KeyPath], Source | None]:
    """Where each key of the file and overrides' data was set: by the last override that set it (or
    a section holding it), else at its line of the file, else by the override that made the section."""

    def source_of(path: KeyPath) -> Source | None:
        for touched, text in reversed(overrides):
            if path[: len(touched)] == touched:
                return override_source(text)
        if path in lines and source is not None:
            return file_source(source, lines[path])
        for touched, text in reversed(overrides):
            if touched[: len(path)] == path:
                return override_source(text)
        return file_source(source, None) if source is not None else None

    return source_of


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
    stderr_line(f"core-rl: note: {message}")


def _file_recipe(before: dict[str, Any], host: PluginHost, source: str | None) -> _RecipeChoice:
    """The recipe the file alone selects, where the overrides changed ``algorithm.name`` (one that
    cannot load counts as none: the file's own choice is not what runs)."""
    try:
        name = _resolve_algorithm_name(before, source)
        if not isinstance(name, str) or not name:
            return _RecipeChoice(None, {})
        return _RecipeChoice(name, build_component(host.get(ALGORITHM, name)).defaults)
    except (ConfigError, PluginError):
        return _RecipeChoice(None, {})


@attrs.define
class MergedConfig:
    """A run configuration merged (:func:`merge_config`), not yet resolved or validated: ``data``,
    plain and with its ``${...}`` interpolations; where each of its keys was set
    (``provenance``); the file it was read from (``source``; ``None`` for none)."""

    data: dict[str, Any]
    provenance: Provenance
    source: str | None

    def resolved(self) -> dict[str, Any]:
        """``data`` with its interpolations resolved; a ConfigError naming the key that cannot be."""
        return _resolved(self.data, self.source)


def merge_config(
    path: str | Path | None, overrides: Sequence[str], host: PluginHost, *, notify: Notify | None = None
) -> MergedConfig:
    """YAML + overrides + the selected algorithm's defaults (the module docstring's steps 1-3),
    with the source of every key. ``notify`` receives notes on what the overrides or the recipe
    left out (options a plugin switch dropped, recipe values depending on the user's); default: print them to
    stderr. Raises :class:`ConfigError` for a file, override or ``algorithm.name`` that cannot be read."""
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
    touched = apply_overrides(data, parsed, expand_name=is_plugin_section)

    chosen = _RecipeChoice(None, {})
    recipe: AlgorithmRecipe | None = None
    distribution = ""
    algorithm = _resolve_algorithm_name(data, source)
    if algorithm:
        if not isinstance(algorithm, str):
            raise ConfigError([f"algorithm.name: expected a string, got {algorithm!r}"], source=source)
        try:
            entry = host.get(ALGORITHM, algorithm)
            recipe = build_component(entry)
        except PluginError as exc:
            raise ConfigError([f"algorithm.name: {exc}"], source=source) from None
        distribution = entry.distribution
        chosen = _RecipeChoice(algorithm, recipe.defaults)
    switched = node_at(before, ("algorithm", "name")) != node_at(data, ("algorithm", "name"))
    earlier = _file_recipe(before, host, source) if switched else chosen
    _drop_foreign_options(before, data, (earlier, chosen), touched, host, source or "the defaults", notify)

    provenance = Provenance()
    lines = yaml_lines(Path(path).read_text(encoding="utf-8")) if path is not None else {}
    provenance.record(data, _user_sources(source, lines, [(t, o.text) for t, o in zip(touched, parsed)]))
    if recipe is not None:
        assert isinstance(algorithm, str)
        defaults = copy.deepcopy(dict(recipe.defaults))
        _yield_dependent_defaults(defaults, data, recipe, algorithm, provenance, notify)
        defaults = _drop_replaced_sections(defaults, data)
        provenance.record(defaults, lambda _path: recipe_source(algorithm, distribution))
        data = _merge_under(defaults, data)
    _fill_default_names(data)
    return MergedConfig(data=data, provenance=provenance, source=source)


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
    return merge_config(path, overrides, host, notify=notify).resolved()


@attrs.frozen
class Validated:
    """What :func:`validate_merged` found: the configuration (``None`` when there are problems),
    the data it checked (interpolations resolved, unless resolving failed) and every problem, each
    with the sources of the values it names (:meth:`~core_rl.config.provenance.Provenance.explain`)."""

    config: RunConfig | None
    data: dict[str, Any]
    problems: list[str]


def validate_merged(
    merged: MergedConfig, host: PluginHost, *, require_complete: bool = True, notify: Notify | None = None
) -> Validated:
    """Resolve and validate a merged configuration (the module docstring's steps 4-5): every
    problem found, none raised. ``require_complete`` and ``notify``: see :func:`load_config`."""
    try:
        data = merged.resolved()
    except ConfigError as exc:
        return Validated(None, merged.data, _explained(exc.problems, merged.data, merged.provenance))
    found = _config_or_problems(merged, data, host, require_complete=require_complete, notify=notify or _stderr_note)
    if isinstance(found, RunConfig):
        return Validated(found, data, [])
    return Validated(None, data, _explained(found, data, merged.provenance))


def _explained(problems: Sequence[str], data: Mapping[str, Any], provenance: Provenance) -> list[str]:
    return [provenance.explain(problem, data) for problem in problems]


def _config_or_problems(
    merged: MergedConfig, data: dict[str, Any], host: PluginHost, *, require_complete: bool, notify: Notify
) -> RunConfig | list[str]:
    """The configuration of resolved ``data``, or its problems."""
    model_path_problems = resolve_model_paths(data, host, notify)  # e.g. a .gguf file -> its HF directory
    if model_path_problems:
        return model_path_problems
    try:
        cfg: RunConfig = structure(data, RunConfig)
    except ConfigError as exc:
        # report problems in the plugin sections too, not only the first layer's
        return exc.problems + raw_plugin_problems(data, host)
    for interpolated in interpolations(merged.data, data):
        record(cfg, interpolated)
    problems: list[str] = source_entry_problems(cfg, host)
    for spec_path, kind, spec in selected_sections(cfg):
        try:
            validate_plugin_section(host, kind, spec, spec_path, run=cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    problems.extend(weight_sync_problems(host, cfg))
    problems.extend(routing_replay_problems(host, cfg))
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
        problems.extend(multimodal_engine_problems(cfg, host))
    return problems or cfg


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
    data). ``notify``: see :func:`merge_config`. Raises :class:`ConfigError` listing every problem
    found, each with where the values it names were set. The keys derived from others
    (:mod:`core_rl.config.derived`) are filled in and recorded in ``derived`` of the result.
    """
    merged = merge_config(path, overrides, host, notify=notify)
    checked = validate_merged(merged, host, require_complete=require_complete, notify=notify)
    if checked.config is None:
        raise ConfigError(checked.problems, source=merged.source)
    return checked.config


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


def marked_yaml(checked: Validated, provenance: Provenance) -> str:
    """A merged configuration that is not valid (``checked``, from :func:`validate_merged`) as
    YAML, as ``core-rl config show`` prints it: every key the file, the overrides and the recipe
    set (defaults are filled in only for a valid configuration), each problem as a comment line
    ``# PROBLEM: ...`` just above the key it names (or above its nearest section present), and the
    problems naming no key present at the top."""
    data = checked.data
    text = yaml.safe_dump(data, sort_keys=False, width=10**9, allow_unicode=True, default_flow_style=False)
    lines = text.splitlines()
    at = yaml_lines(text)
    above: dict[int, list[str]] = {}
    top: list[str] = []
    for problem in checked.problems:
        comment = "# PROBLEM: " + " ".join(problem.split())
        found = provenance.mentioned(problem, data)
        path = found[0] if found else ()
        while path and path not in at:
            path = path[:-1]
        if path:
            above.setdefault(at[path], []).append(comment)
        else:
            top.append(comment)
    count = len(checked.problems)
    out = [f"# invalid configuration: {count} problem{'s' if count != 1 else ''}, marked '# PROBLEM:' below", *top]
    for number, line in enumerate(lines, start=1):
        indent = line[: len(line) - len(line.lstrip(" -"))].replace("-", " ")
        out.extend(indent + comment for comment in above.get(number, []))
        out.append(line)
    return "\n".join(out) + "\n"
