"""Loading a user's function that a configuration names: ``package.module:function`` (imported) or
``path/to/file.py:function`` (the file loaded as a module of its own), for the ``function`` reward
and plugins such as the OpenAI proxy's agent programs.

A relative file path is resolved against the working directory, as every other path of a run
configuration is (``data.train_files``, ``actor.model_path``). A file is executed once per process
while it is unchanged (cached by path, modification time and size) and registered in
``sys.modules`` under a name of its own, so what it defines pickles and a second load is free.

Every failure is a :class:`LoadFailed` with one line saying what to fix: the resolved path of a
missing file, ``file:line`` and the exception of a file that does not run (a syntax error, an
import that fails), or the callables a module has when the named one is missing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

#: ``package.module:function`` or ``path/to/file.py:function``
CALLABLE = re.compile(r"^([A-Za-z_][\w.]*|.+\.py):[A-Za-z_]\w*$")

#: what the error messages call a well-formed reference
CALLABLE_FORMS = "'path/to/file.py:function' or 'package.module:function'"

_loaded: dict[tuple[Path, int, int], ModuleType] = {}


class LoadFailed(Exception):
    """A function reference that cannot be loaded; ``str(exc)`` is one line saying why."""


def resolve_file(path: str | Path) -> Path:
    """``path`` made absolute against the working directory (not following symbolic links)."""
    return Path(path) if Path(path).is_absolute() else Path.cwd() / path


def _where_it_failed(exc: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``exc`` in ``path`` (the file's own line that raised),
    or of a syntax error's position; ``path`` alone when neither is known."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{exc.filename}:{exc.lineno}"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename) == path:
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


def load_file(path: str | Path) -> ModuleType:
    """The module of the Python file ``path`` (resolved by :func:`resolve_file`), executed once while
    it is unchanged. Raises :class:`LoadFailed`."""
    resolved = resolve_file(path)
    if not resolved.is_file():
        raise LoadFailed(f"no file {resolved} ({str(path)!r} from the working directory {Path.cwd()})")
    stat = resolved.stat()
    key = (resolved, stat.st_mtime_ns, stat.st_size)
    if key in _loaded:
        return _loaded[key]
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"core_rl_user_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        message = str(exc).splitlines()[0] if str(exc) else ""
        if isinstance(exc, SyntaxError):
            message = exc.msg
        where = _where_it_failed(exc, resolved)
        loading = "" if where.startswith(f"{resolved}:") else f" (while loading {resolved})"
        raise LoadFailed(f"{where}: {type(exc).__name__}: {message}{loading}") from exc
    _loaded[key] = module
    return module


def module_callables(module: ModuleType) -> list[str]:
    """The public callables ``module`` defines itself (functions and classes, not imported ones)."""
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == module.__name__
    )


def load_callable(reference: str) -> Callable[..., Any]:
    """The callable ``reference`` names (:data:`CALLABLE`). Raises :class:`LoadFailed`."""
    if not CALLABLE.match(reference):
        raise LoadFailed(f"{reference!r} names no function; write {CALLABLE_FORMS}")
    source, _, name = reference.rpartition(":")
    if source.endswith(".py"):
        module = load_file(source)
        origin = str(resolve_file(source))
    else:
        try:
            module = importlib.import_module(source)
        except Exception as exc:
            raise LoadFailed(f"cannot import {source!r}: {type(exc).__name__}: {exc} (is it importable?)") from exc
        origin = f"module {source!r}"
    if not hasattr(module, name):
        has = ", ".join(module_callables(module)) or "none"
        raise LoadFailed(f"{origin} has no {name!r}; the callables it defines: {has}")
    function = getattr(module, name)
    if not callable(function):
        raise LoadFailed(f"{origin}: {name!r} is a {type(function).__name__}, not a function")
    return function


def is_async(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` returns a coroutine to await (an ``async def`` function, or an
    object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 (the method, not callability)
    )
