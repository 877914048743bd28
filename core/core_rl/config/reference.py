"""The configuration reference, generated from the schemas themselves so that it cannot drift: every
key of a run (:class:`core_rl.config.schema.RunConfig`, walked section by section) and every key of
each installed plugin's ``config_cls``, with its type, its default, what it accepts (read off the
field's validators: each of :mod:`core_rl.config.validators` carries its ``requirement``), the
``#:`` comment above the field in the source, and each section's docstring.

``core-rl config reference`` prints it; the docs site builds its "Configuration reference" page from
it (``docs/hooks/generated_pages.py``).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

import attrs

from core_rl.config.plugin_spec import PluginSpec

#: a field line of an attrs class body: ``name: type`` or ``name: type = ...``
_FIELD_LINE = re.compile(r"^\s+(?P<name>[a-z_][a-z0-9_]*)\s*:")


@attrs.frozen
class KeyRow:
    """One key of a section: its dotted ``path``, ``type`` and ``default`` as text, what it
    ``accepts`` (empty: anything of its type) and the comment above it in the source."""

    path: str
    type: str
    default: str
    accepts: str
    comment: str


@attrs.frozen
class Section:
    """A section: its dotted ``path`` (``""``: the top level), the class's docstring, its keys."""

    path: str
    doc: str
    rows: tuple[KeyRow, ...]


def requirement(validator: Any) -> str:
    """What ``validator`` accepts, in words: its ``requirement`` attribute, those of an
    ``attrs.validators.and_`` joined, ``"or null"`` for ``optional``; ``""`` when unknown."""
    if validator is None:
        return ""
    if text := getattr(validator, "requirement", None):
        return str(text)
    if inner := getattr(validator, "_validators", None) or getattr(validator, "validators", None):
        return "; ".join(filter(None, (requirement(v) for v in inner)))
    if (inner := getattr(validator, "validator", None)) is not None:  # attrs.validators.optional
        words = requirement(inner)
        return f"{words}, or null" if words else ""
    return ""


def field_comments(cls: type) -> dict[str, str]:
    """``field -> comment`` from the ``#:`` lines right above each field in ``cls``'s source."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD_LINE.match(line)
        if match and pending:
            comments[match["name"]] = " ".join(pending)
        if stripped:
            pending = []
    return comments


def type_name(annotation: Any) -> str:
    """A field's type as the reader writes it in YAML: ``int``, ``float | null``, ``list[str]``."""
    if annotation is None:
        return ""
    if isinstance(annotation, str):
        return annotation.replace("None", "null")
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: attrs.Attribute) -> str:
    """The field's default as the reader writes it in YAML (``required`` where it has none)."""
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        value = default.factory() if not default.takes_self else attrs.NOTHING
    else:
        value = default
    if value is attrs.NOTHING:
        return "required"
    if isinstance(value, PluginSpec):  # a plugin section's default: its plugin's name
        return f"name: {value.name}"
    if attrs.has(type(value)):
        return "(section)"
    if isinstance(value, list) and value and all(isinstance(v, PluginSpec) for v in value):
        return "[" + ", ".join(f"name: {v.name}" for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value else '""'
    return str(value)


def _nested_class(field: attrs.Attribute, hints: dict[str, Any]) -> type | None:
    """The attrs class a field holds (also through ``X | None``), or ``None``."""
    annotation = hints.get(field.name, field.type)
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and attrs.has(candidate) and candidate.__name__ != "PluginSpec":
            return candidate
    return None


def sections(cls: type, path: str = "") -> Iterator[Section]:
    """``cls``'s own keys as one :class:`Section` at ``path``, then each nested attrs section's,
    depth first, in field order. A field holding another section is a row of its own too."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation naming something only importable for type checking
        hints = {}
    comments = field_comments(cls)
    for base in cls.__mro__[1:]:
        if attrs.has(base):
            comments = {**field_comments(base), **comments}
    rows, nested = [], []
    for field in attrs.fields(cls):
        if not field.init or field.name.startswith("_"):
            continue
        key = f"{path}.{field.name}" if path else field.name
        child = _nested_class(field, hints)
        rows.append(
            KeyRow(
                path=key,
                type="section" if child is not None else type_name(hints.get(field.name, field.type)),
                default=_default(field),
                accepts=requirement(field.validator),
                comment=_doc_block(comments.get(field.name, "")),
            )
        )
        if child is not None:
            nested.append((child, key))
    yield Section(path=path, doc=inspect.cleandoc(cls.__doc__ or ""), rows=tuple(rows))
    for child, key in nested:
        yield from sections(child, key)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(section: Section) -> str:
    """``section``'s keys as a Markdown table."""
    lines = ["| key | type | default | accepts | notes |", "| --- | --- | --- | --- | --- |"]
    for row in section.rows:
        cells = (f"`{row.path}`", _cell(row.type), f"`{_cell(row.default)}`", _cell(row.accepts), _cell(row.comment))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _doc_block(doc: str) -> str:
    """A docstring as Markdown text: reST's double backquotes and roles made plain code."""
    text = re.sub(r":(?:class|mod|func|meth|attr|data):`~?([^`]+)`", r"`\1`", doc)
    return text.replace("``", "`")


def run_reference() -> str:
    """Every key of a run's configuration, section by section."""
    from core_rl.config.schema import RunConfig

    parts = []
    for section in sections(RunConfig):
        title = f"`{section.path}`" if section.path else "Top level"
        depth = "#" * min(2 + section.path.count(".") + (1 if section.path else 0), 5)
        parts += [f"{depth} {title}", _doc_block(section.doc), markdown_table(section)]
    return "\n\n".join(p for p in parts if p)


def plugin_reference(host: Any | None = None) -> str:
    """The keys of every installed plugin that takes options (its ``config_cls``), by kind."""
    from core_rl.plugins.host import PluginHost

    host = host or PluginHost()
    host.load_all()
    parts = []
    for registry in host.registries.values():
        entries = [registry.get(name) for name in sorted(registry.names())]
        entries = [e for e in entries if e is not None and e.config_cls is not None and attrs.has(e.config_cls)]
        if not entries:
            continue
        parts.append(f"### {registry.kind.label} plugins")
        for entry in entries:
            parts.append(f"#### `{entry.name}` ({entry.distribution})")
            if entry.description:
                parts.append(entry.description)
            for section in sections(entry.config_cls):
                if section.path:
                    parts.append(f"##### `{section.path}`")
                if section.doc:
                    parts.append(_doc_block(section.doc))
                if section.rows:
                    parts.append(markdown_table(section))
    return "\n\n".join(parts)


def reference_markdown() -> str:
    """The whole reference page: the run's keys, then the installed plugins' keys."""
    intro = textwrap.dedent(
        """\
        # Configuration reference

        Generated from the configuration classes (`core_rl.config.reference`; `core-rl config reference`
        prints it for the plugins installed where it runs). Keys are dotted paths into the YAML file
        and the command line's `key=value` overrides. "accepts" is what the loader checks; a value
        outside it stops the run before it starts, naming the key.
        """
    )
    plugin_intro = (
        "## Plugin sections\n\nA section selected by name (`actor.engine`, `rollout.engine`, `algorithm.loss`, "
        "`reward`, `loggers[]`, ...) takes `name:` and the keys of the selected plugin's own config class."
    )
    parts = [intro.strip(), "## Run configuration", run_reference(), plugin_intro, plugin_reference()]
    return "\n\n".join(parts) + "\n"
