"""Where each value of a merged configuration came from, and problems that say so.

A key of the merged data (:func:`core_rl.config.loader.merge_config`) was set by a line of the YAML
file, by a command-line override, or by the selected algorithm recipe's defaults; a key none of them
set takes the default of its section's config class. :class:`Provenance` records the first three,
key path by key path, and :meth:`Provenance.explain` appends to a problem the source of each value
it names, so a message about two keys that disagree says where each one was set::

    algorithm.loss.eps_clip_higher: must be >= eps_clip (0.2) or null, got 0.1 (values:
    algorithm.loss.eps_clip_higher=0.1 on the command line (algorithm.loss.eps_clip_higher=0.1);
    algorithm.loss.eps_clip=0.2 in examples/tiny_grpo/grpo.yaml:38)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import yaml

from core_rl.config.paths import Path, format_path, is_set, node_at, parse_key


@attrs.frozen
class Source:
    """Where a value was set: the kind of place (``file``, ``command line``, ``recipe`` or
    ``default``) and the place as a message says it (``in grpo.yaml:38``, ``on the command line
    (lr=1e-3)``, ``by the 'gspo' recipe's defaults (core-rl-gspo; ...)``, ``by default``)."""

    kind: Literal["file", "command line", "recipe", "default"]
    where: str


DEFAULT = Source("default", "by default")


def file_source(file: str, line: int | None) -> Source:
    """A value written in ``file`` (at the 1-based ``line``, where known)."""
    return Source("file", f"in {file}:{line}" if line is not None else f"in {file}")


def override_source(text: str) -> Source:
    """A value set by the command-line override ``text``."""
    return Source("command line", f"on the command line ({text})")


def recipe_source(name: str, distribution: str) -> Source:
    """A value of the algorithm recipe ``name``'s defaults (registered by ``distribution``)."""
    return Source("recipe", f"by the {name!r} recipe's defaults ({distribution}; a value you set replaces it)")


def yaml_lines(text: str) -> dict[Path, int]:
    """The 1-based line of each key and list item of the YAML document ``text``, by key path (the
    root mapping's keys at depth 1). Keys brought in by a merge key (``<<: *base``) are not listed;
    text that does not parse gives no lines."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[Path, int] = {}

    def walk(node: yaml.Node, path: Path) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                    continue
                here = (*path, key_node.value)
                lines[here] = key_node.start_mark.line + 1
                walk(value_node, here)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                here = (*path, i)
                lines[here] = item.start_mark.line + 1
                walk(item, here)

    if root is not None:
        walk(root, ())
    return lines


def walk_paths(data: Any, path: Path = ()) -> Iterator[Path]:
    """Every key path of plain ``data`` below ``path`` (mapping keys and list indices), parents first."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            yield (*path, key)
            yield from walk_paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield (*path, i)
            yield from walk_paths(value, (*path, i))


_DOTTED_PATH = re.compile(r"(?<![\w.\[])[A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)+")
_UNKNOWN_KEY = re.compile(r"^\S+: unknown key\b")
#: option names messages use as English words (``must name a registered plugin``)
_NOT_AN_OPTION = frozenset({"name"})


class Provenance:
    """The source of every key the file, the overrides or the recipe set (:class:`Source`), by key
    path; any other key has its default (:data:`DEFAULT`)."""

    def __init__(self) -> None:
        self._sources: dict[Path, Source] = {}

    def record(self, data: Any, source_of: Callable[[Path], Source | None], root: Path = ()) -> None:
        """Record ``source_of(path)`` for every key path of ``data`` (which sits at ``root``) not
        recorded yet; ``None`` records nothing for that path."""
        for path in walk_paths(data, root):
            if path not in self._sources:
                source = source_of(path)
                if source is not None:
                    self._sources[path] = source

    def source(self, path: Path) -> Source:
        """Where the value at ``path`` was set (:data:`DEFAULT` where nothing set it)."""
        return self._sources.get(tuple(path), DEFAULT)

    def mentioned(self, problem: str, data: Mapping[str, Any]) -> list[Path]:
        """The key paths ``problem`` names, in order:

        - the one it starts with (``key.path: ...``) and, where nothing set that key, the nearest
          section holding it that something set (the recipe's ``teacher:`` for
          ``teacher.model_path: required``);
        - every other dotted key path in it that ``data`` holds or that was recorded;
        - the options beside the first key (same section; not sections) that it names by their
          bare name, unquoted, as a plugin's own messages do (``must be >= eps_clip``, but not
          ``did you mean 'scale'?``)."""
        head, sep, rest = problem.partition(": ")
        lead = _key_path(head.strip()) if sep else None
        found: list[Path] = []
        if lead is not None:
            found.append(lead)
            section = lead[:-1]
            while section and section not in self._sources:
                section = section[:-1]
            if section and lead not in self._sources:
                found.append(section)
        text = rest if lead is not None else problem
        for match in _DOTTED_PATH.finditer(text):
            path = _key_path(match.group(0))
            if path is not None and path not in found and (path in self._sources or is_set(data, path)):
                found.append(path)
        if lead is not None:
            found.extend(path for path in self._options_named(text, lead, data) if path not in found)
        return found

    def _options_named(self, text: str, lead: Path, data: Mapping[str, Any]) -> list[Path]:
        """The recorded options of ``lead``'s section that ``text`` names by their bare name."""
        section = node_at(data, lead[:-1])
        if not isinstance(section, Mapping):
            return []
        named = []
        for key, value in section.items():
            path = (*lead[:-1], key)
            if key in _NOT_AN_OPTION or isinstance(value, (Mapping, list)) or path not in self._sources:
                continue  # a section is no option: "preference loss" does not name algorithm.loss
            if re.search(rf"(?<![\w.'\"]){re.escape(str(key))}(?![\w.'\"])", text):
                named.append(path)
        return named

    def explain(self, problem: str, data: Mapping[str, Any]) -> str:
        """``problem`` with the source of each value it names (:meth:`mentioned`) appended, where
        those come from different kinds of places (the file and the command line, say) or one
        from the recipe: what the user cannot tell from the message and what they wrote. A
        problem about values of one place the user wrote (the file alone), about defaults alone,
        or about a key's name (``unknown key``) is left as it is. The form: ``... (values:
        key=value in file:line; other=value by the 'x' recipe's defaults ...)``."""
        if _UNKNOWN_KEY.search(problem):
            return problem
        paths = self.mentioned(problem, data)
        kinds = {self._sources[path].kind for path in paths if path in self._sources}
        if len(kinds) < 2 and "recipe" not in kinds:
            return problem
        parts = []
        for path in paths:
            value = node_at(data, path)
            shown = f"={_short(value)}" if value is not None and not isinstance(value, (Mapping, list)) else ""
            source = self.source(path)
            where = "not set" if source == DEFAULT and not is_set(data, path) else source.where
            parts.append(f"{format_path(path)}{shown} {where}")
        return f"{problem} (values: {'; '.join(parts)})"


def _key_path(text: str) -> Path | None:
    try:
        return parse_key(text)
    except ValueError:
        return None


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n")
    text = text.strip()
    return text if len(text) <= 60 else text[:57] + "..."
