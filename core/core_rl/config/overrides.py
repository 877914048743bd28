"""Command-line overrides: ``key.path=value`` sets a key, ``~key.path`` deletes one.

Key paths are dotted names with list indices in either spelling: ``loggers[1].name`` or
``loggers.1.name``. Values are YAML (``lr=1e-5``, ``betas=[0.9,0.95]``,
``reward={name: exact_match, answer_key: solution}``); ``${...}`` interpolations may appear
unquoted anywhere in a value, flow collections included.

Each override *sets* the node at its path to exactly the value given: a mapping or list replaces
the section wholesale (keys of the file's section that the value does not repeat fall back to their
defaults); to change one key of a section, set ``section.key=value``. Missing intermediate sections
are created; an index may address an existing item or the position just past the end (appending).

Overrides apply in order to the configuration file's data, before interpolations are resolved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core_rl.config.paths import Path, Segment, format_path, parse_key
from core_rl.errors import ConfigError

__all__ = ["Override", "apply_overrides", "first_line", "format_path", "parse_key", "parse_override", "parse_overrides"]

_PLACEHOLDER = "__core_rl_interpolation_{}__"
_QUOTE_OPENERS = "[{,:"


@attrs.frozen
class Override:
    """One parsed override: ``path`` (names; ``int`` for ``[i]`` indices), whether it deletes,
    and the parsed value. ``text`` is the override as given, for messages."""

    text: str
    path: Path
    delete: bool = False
    value: Any = None


def _quote_may_open(out: list[str]) -> bool:
    """Whether a quote character here starts a YAML quoted scalar (at the start of a token)."""
    before = "".join(out).rstrip()
    return not before or before[-1] in _QUOTE_OPENERS


def _protect_interpolations(text: str) -> tuple[str, list[str]]:
    """Replace each unquoted ``${...}`` (nested ones included) with a placeholder YAML reads as
    plain text; return the new text and the interpolations in order."""
    out: list[str] = []
    found: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\" and quote == '"':
                out.append(text[i : i + 2])
                i += 2
                continue
            if c == quote:
                quote = None
            out.append(c)
            i += 1
            continue
        if c in "'\"" and _quote_may_open(out):
            quote = c
        elif text.startswith("${", i):
            depth, j = 0, i
            while j < len(text):
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            else:
                raise ValueError(f"the interpolation starting at {text[i:]!r} is not closed with '}}'")
            out.append(_PLACEHOLDER.format(len(found)))
            found.append(text[i : j + 1])
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out), found


def _restore(value: Any, found: list[str]) -> Any:
    if isinstance(value, str):
        for n, interpolation in enumerate(found):
            value = value.replace(_PLACEHOLDER.format(n), interpolation)
        return value
    if isinstance(value, dict):
        return {_restore(k, found): _restore(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, found) for v in value]
    return value


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (OmegaConf's own ``msg`` when it has one); OmegaConf
    appends ``full_key: ...`` lines that messages name otherwise."""
    text = str(getattr(exc, "msg", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _yaml_problem(exc: Exception) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(p for p in (exc.context, exc.problem) if p)
    return first_line(exc)


def parse_value(text: str) -> Any:
    """Parse an override's value as YAML, the way OmegaConf reads values (``1e-5`` is a float);
    raise ``ValueError`` saying why it cannot be read."""
    protected, found = _protect_interpolations(text)
    try:
        node = OmegaConf.from_dotlist([f"v={protected}"])
        value = OmegaConf.to_container(node, resolve=False)["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ValueError(_yaml_problem(exc)) from None
    return _restore(value, found)


def parse_override(text: str) -> Override:
    """Parse ``key.path=value`` or ``~key.path``; raise ``ValueError`` saying what is wrong."""
    if text.startswith("~"):
        key, sep, _ = text[1:].partition("=")
        if sep:
            raise ValueError("a deletion takes no value: write ~key.path")
        return Override(text, parse_key(key.strip()), delete=True)
    key, sep, raw = text.partition("=")
    if not sep:
        raise ValueError("must look like key.path=value (or ~key.path to delete a key)")
    path = parse_key(key.strip())
    try:
        value = parse_value(raw)
    except ValueError as exc:
        raise ValueError(
            f"cannot read the value {raw!r}: {exc}; quote it (key='\"...\"' in a shell) if it is a string"
        ) from None
    return Override(text, path, value=value)


def parse_overrides(texts: Sequence[str]) -> list[Override]:
    """Parse every override; raise :class:`ConfigError` listing each one that cannot be read."""
    parsed, problems = [], []
    for text in texts:
        try:
            parsed.append(parse_override(text))
        except ValueError as exc:
            problems.append(f"override {text!r}: {exc}")
    if problems:
        raise ConfigError(problems)
    return parsed


def _items(count: int, where: Path) -> str:
    return f"{format_path(where)} has {count} item{'' if count == 1 else 's'}"


def _describe_node(value: Any) -> str:
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} ({value!r})"


class _Walker:
    """Resolves path segments against plain data (dicts and lists)."""

    def __init__(self, expand_name: Callable[[Path], bool]) -> None:
        self.expand_name = expand_name

    @staticmethod
    def key_in(node: Any, seg: Segment, where: Path) -> Segment:
        """The dict key or list index ``seg`` addresses in ``node``."""
        if isinstance(node, list):
            if isinstance(seg, int):
                return seg
            if seg.isdigit():
                return int(seg)
            shown = format_path(where)
            raise ValueError(f"{shown} is a list; address its items by index, e.g. {shown}[0]")
        if isinstance(seg, int):
            if seg in node:
                return seg
            raise ValueError(f"{format_path(where)} is a mapping, not a list; [{seg}] indexes lists")
        if seg not in node and seg.isdigit() and int(seg) in node:
            return int(seg)  # an integer key written in the YAML
        return seg

    def descend(
        self, node: Any, seg: Segment, where: Path, *, create: bool, next_is_index: bool = False
    ) -> tuple[Any, Segment]:
        """The child of ``node`` at ``seg`` and its key. With ``create``, a missing (or null) child
        becomes an empty list when ``next_is_index`` (the path goes on with an index), else an
        empty mapping."""
        key = self.key_in(node, seg, where)
        here = (*where, key)
        if isinstance(node, list):
            assert isinstance(key, int)
            if create and key == len(node):
                node.append(None)  # a new item just past the end
            elif key >= len(node):
                raise ValueError(f"{format_path(here)}: index out of range; {_items(len(node), where)}")
            child = node[key]
        elif key in node:
            child = node[key]
        elif create:
            child = None
        else:
            raise KeyError(key)
        if create and child is None:
            child = [] if next_is_index else {}
            node[key] = child
        elif create and isinstance(child, str) and self.expand_name(here):
            child = {"name": child}  # `engine: fsdp` is short for `engine: {name: fsdp}`
            node[key] = child
        elif not isinstance(child, (dict, list)):
            raise ValueError(f"{format_path(here)} is {_describe_node(child)}, not a section")
        return child, key


def apply_overrides(
    data: dict[Any, Any],
    overrides: Sequence[Override],
    *,
    expand_name: Callable[[Path], bool] = lambda _path: False,
) -> list[Path]:
    """Apply ``overrides`` in order to ``data`` (changed in place).

    ``expand_name(path)`` tells whether a string at ``path`` is a plugin section's short form
    (``engine: fsdp``), which setting a key below it expands to ``{name: fsdp}``. Returns the path
    each override touched, with list indices as ``int``. Raises :class:`ConfigError` listing every
    override that cannot apply.
    """
    walker = _Walker(expand_name)
    touched: list[Path] = []
    problems: list[str] = []
    for override in overrides:
        try:
            touched.append(_apply_one(data, override, walker))
        except ValueError as exc:
            problems.append(f"override {override.text!r}: {exc}")
        except KeyError:
            problems.append(
                f"override {override.text!r}: {format_path(override.path)} is not set (neither in the file nor by an "
                "earlier override), so there is nothing to delete"
            )
    if problems:
        raise ConfigError(problems)
    return touched


def _apply_one(data: dict[Any, Any], override: Override, walker: _Walker) -> Path:
    node: Any = data
    where: Path = ()
    for depth, seg in enumerate(override.path[:-1]):
        following = override.path[depth + 1]
        next_is_index = isinstance(following, int) or following.isdigit()
        node, key = walker.descend(node, seg, where, create=not override.delete, next_is_index=next_is_index)
        where = (*where, key)
    key = walker.key_in(node, override.path[-1], where)
    here = (*where, key)
    if override.delete:
        if isinstance(node, list):
            if not isinstance(key, int) or key >= len(node):
                raise KeyError(key)
            del node[key]
        else:
            del node[key]
        return here
    if isinstance(node, list):
        assert isinstance(key, int)
        if key < len(node):
            node[key] = override.value
        elif key == len(node):
            node.append(override.value)
        else:
            raise ValueError(f"{format_path(here)}: index out of range; {_items(len(node), where)}")
    else:
        node[key] = override.value
    return here
