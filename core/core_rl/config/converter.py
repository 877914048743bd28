"""Typed structuring of plain configuration data into the attrs classes of
:mod:`core_rl.config.schema` (and plugins' ``config_cls``), with cattrs.

:func:`structure` is strict: unknown keys, missing required keys, values of the wrong type
(``"1"`` is not an integer, a string is not a list) and values a field's validators refuse are
all reported at once, one message per problem with its key path, as a :class:`ConfigError`:
``actor.optimizer.lr: must be in (0, 10], got 50.0`` or ``actor.optimzer: unknown key; did you mean
'optimizer'?``. :data:`CONVERTER` also unstructures a configuration back to plain data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_unstructure_fn, override

from core_rl.config.model_sections import AUTO, TokenBudget
from core_rl.config.schema import AutoBool, PluginSpec, RunConfig, TrainFile
from core_rl.config.validators import FieldValueError
from core_rl.errors import ConfigError, did_you_mean


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


def _token_budget(value: Any, _t: Any) -> int | str:
    """``auto`` or an integer (a ``max_tokens_per_mb``)."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeMismatch("an integer or 'auto'", value)
    return value


def _auto_bool(value: Any, _t: Any) -> bool | str:
    """``true``, ``false`` or ``auto`` (an :data:`~core_rl.config.schema.AutoBool` switch)."""
    if value == AUTO or isinstance(value, bool):
        return value
    raise TypeMismatch("true, false or 'auto'", value)


def structure_plugin_spec(value: Any, _t: type) -> PluginSpec:
    if isinstance(value, str):
        return PluginSpec(name=value)
    if not isinstance(value, Mapping):
        raise TypeMismatch("a mapping with a 'name' key (or just the name)", value)
    if "name" not in value or not isinstance(value["name"], str) or not value["name"]:
        raise FieldValueError("name", value.get("name"), "must name a registered plugin")
    options = {k: v for k, v in value.items() if k != "name"}
    return PluginSpec(name=value["name"], options=options)


#: an entry of ``data.train_files``: a path, or a weighted source
TrainEntry = str | TrainFile


def _train_entry(conv: cattrs.Converter, value: Any) -> str | TrainFile:
    """A path as it is, a mapping as a :class:`TrainFile` (its keys checked like a section's)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise TypeMismatch("a path, or a mapping {path: ..., weight: ...}", value)
    return conv.structure(value, TrainFile)


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
    conv.register_structure_hook(PluginSpec, structure_plugin_spec)
    conv.register_structure_hook_func(lambda t: t == TrainEntry, lambda v, _t: _train_entry(conv, v))
    conv.register_structure_hook_func(lambda t: t == TokenBudget, _token_budget)
    conv.register_structure_hook_func(lambda t: t == AutoBool, _auto_bool)
    conv.register_unstructure_hook(PluginSpec, lambda spec: unstructure_spec(conv, spec))
    # what the loader derived is kept beside the configuration, not in it
    conv.register_unstructure_hook(RunConfig, make_dict_unstructure_fn(RunConfig, conv, derived=override(omit=True)))
    return conv


def unstructure_spec(conv: cattrs.Converter, spec: PluginSpec) -> dict[str, Any]:
    options = conv.unstructure(spec.config) if spec.config is not None else dict(spec.options)
    return {"name": spec.name, **options}


CONVERTER = make_converter()


_PLAIN_KEY = re.compile(r"[\w-]+")


def join_path(path: str, key: Any) -> str:
    """``path`` extended by ``key``: ``a.b`` + ``c`` is ``a.b.c``, ``a.b`` + ``0`` is ``a.b[0]``."""
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _describe(exc: BaseException, path: str) -> Iterator[str]:
    """Flatten a cattrs validation error tree into one message per problem."""
    if isinstance(exc, ForbiddenExtraKeysError):
        valid = [a.name for a in attrs.fields(exc.cl)]
        for key in sorted(exc.extra_fields, key=str):
            if not isinstance(key, str):
                yield f"{join_path(path, repr(key))}: unknown key (keys are names; valid keys: {', '.join(valid)})"
                continue
            close = did_you_mean(key, valid)
            hint = f"; did you mean {close!r}?" if close else f"; valid keys: {', '.join(valid)}"
            shown = key if _PLAIN_KEY.fullmatch(key) else repr(key)  # quote keys like ';' or 'my key'
            yield f"{join_path(path, shown)}: unknown key{hint}"
    elif isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:  # a field's note names it, an item's its index
            key = note.name if isinstance(note, AttributeValidationNote) else note.index
            yield from _describe(sub, join_path(path, key))
        for sub in without:
            yield from _describe(sub, path)
    elif isinstance(exc, FieldValueError):
        yield f"{join_path(path, exc.field)}: {exc.requirement}, got {exc.value!r}"
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
