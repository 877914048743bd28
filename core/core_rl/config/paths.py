"""Key paths of plain configuration data: ``("loggers", 1, "name")``, written ``loggers[1].name``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

Segment = str | int
Path = tuple[Segment, ...]

_PART = re.compile(r"([^\[\]]*)((?:\[[^\[\]]*\])*)")
_INDEX = re.compile(r"\[([^\[\]]*)\]")


def format_path(path: Sequence[Segment]) -> str:
    """``("loggers", 1, "name")`` -> ``"loggers[1].name"``."""
    out = ""
    for seg in path:
        out += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if out else str(seg))
    return out


def node_at(data: Any, path: Sequence[Segment]) -> Any:
    """The node at ``path`` (names and list indices) of plain data, or ``None`` where there is none."""
    node = data
    for key in path:
        if isinstance(node, Mapping):
            node = node.get(key)
        elif isinstance(node, list) and _is_index(key, node):
            node = node[key]
        else:
            return None
    return node


def is_set(data: Any, path: Sequence[Segment]) -> bool:
    """Whether plain ``data`` holds the key at ``path`` (a mapping's key, even one set to ``None``)."""
    parent = node_at(data, path[:-1])
    return isinstance(parent, Mapping) and path[-1] in parent


def parse_key(key: str) -> Path:
    """Parse a dotted key path; raise ``ValueError`` saying what is wrong with it."""
    if not key:
        raise ValueError("the key path is empty")
    path: list[Segment] = []
    for part in key.split("."):
        match = _PART.fullmatch(part)
        if part == "":
            raise ValueError("the key path has an empty part (two dots in a row, or a dot at an end)")
        if match is None:
            raise ValueError(f"cannot read {part!r}: brackets must hold a list index and close, as in loggers[0]")
        name, indices = match.groups()
        if name:
            path.append(name)
        elif not path:
            raise ValueError("the key path starts with an index; it must start with a name")
        for raw in _INDEX.findall(indices):
            if not raw.isdigit():
                raise ValueError(f"[{raw}] is not a list index; indices are non-negative integers, as in loggers[0]")
            path.append(int(raw))
    return tuple(path)


def replace_at(data: Any, path: Path, value: Any) -> bool:
    """Set the node at ``path`` of plain ``data`` to ``value`` where that node exists; whether it did."""
    parent = node_at(data, path[:-1])
    key = path[-1]
    if (isinstance(parent, dict) and key in parent) or (isinstance(parent, list) and _is_index(key, parent)):
        parent[key] = value
        return True
    return False


def _is_index(key: Any, items: list[Any]) -> bool:
    return isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(items)
