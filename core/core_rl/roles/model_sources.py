"""Model paths through the model sources: every ``model_path`` / ``tokenizer_path`` of a configuration
offered to the installed model sources (a plugin kind registered through
:func:`core_rl.hookspecs.core_rl_register_model_sources`; the contract:
:class:`core_rl.interfaces.ModelSource`) before the configuration is validated.

- The sources are asked in the order of their registered names; the first that answers with a
  directory replaces the path with it. A path no source claims is kept as it is (a local directory
  or a hub id, which the engines load themselves; a path naming nothing is the preflight's to
  report).
- A source that raises a :class:`~core_rl.errors.CoreRLError` for a path it claims gives one problem
  line naming the key path, the source and its distribution (:func:`core_rl.plugins.attribution.who`);
  any other exception, or an answer that is no path, is a :class:`~core_rl.errors.PluginFault`.
- A path ending in a suffix a source of this repository reads (:data:`KNOWN_MODEL_FILES`) that no
  installed source claims is a problem saying why that source is not there: not installed (with the
  ``pip install "core-rl[<extra>]"`` of :data:`core_rl.plugins.kinds.KNOWN_EXTRAS`), blocked, or
  failing to load.

The sources are loaded (their entry points imported and each built once) only when a configuration
names a model path; a source's module imports nothing heavy, so loading a configuration stays cheap.
:func:`resolve_model_paths` is what the configuration loader calls (:mod:`core_rl.config.loader`,
step 4); :func:`resolve_model_path` resolves one path the same way (the real-model fixture,
:mod:`core_rl.testing.real_model`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core_rl.errors import CoreRLError, PluginError, PluginFault
from core_rl.interfaces.model_sources import ModelSource
from core_rl.plugins.attribution import calling, who
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import MODEL_SOURCE
from core_rl.plugins.registry import RegistryEntry

#: the environment variable naming core-rl's cache directory (default ``~/.cache/core-rl``)
HOME_ENV = "CORE_RL_HOME"
#: plain-configuration keys whose string values name a model (or tokenizer) directory or file
PATH_KEYS = ("model_path", "tokenizer_path")
#: file suffixes that a model source of this repository reads -> its registered name, for the
#: problem of such a path when that source is not installed
KNOWN_MODEL_FILES: dict[str, str] = {".gguf": "gguf"}

Notify = Callable[[str], None]


class ModelPathError(CoreRLError):
    """A model path that cannot be had: the source that claims it cannot read it, or no installed
    source reads its kind of file. The message is one line starting with where the path was named."""


def models_root() -> Path:
    """``$CORE_RL_HOME/models`` (``~/.cache/core-rl/models`` by default): where model sources keep
    what they fetch or convert, and the real-model fixture its downloads."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "core-rl") / "models"


def installed_sources(host: PluginHost) -> list[tuple[RegistryEntry, ModelSource]]:
    """Every model source ``host`` can load (an entry point that fails to load is left out, as
    ``core-rl plugins`` shows), each built once, in the order of their registered names."""
    host.load_kind(MODEL_SOURCE)
    return [(entry, build_component(entry)) for entry in host.registries[MODEL_SOURCE.key]]


def resolve_model_path(
    path: str,
    *,
    where: str = "model_path",
    host: PluginHost | None = None,
    notify: Notify | None = None,
) -> str:
    """The local directory of the model ``path`` as a configuration would get it (see the module
    docstring): what the first installed source that claims it returns, else ``path`` itself.
    ``where`` names the path in messages (a key path). Raises :class:`ModelPathError` where the
    claiming source cannot read it, or no installed source reads its kind of file."""
    host = host if host is not None else PluginHost()
    return _resolved(path, where, installed_sources(host), host, notify)


def resolve_model_paths(data: Any, host: PluginHost, notify: Notify | None = None) -> list[str]:
    """Replace, in the plain configuration ``data`` (nested dicts and lists), every non-empty string
    ``model_path`` or ``tokenizer_path`` with its local directory (:func:`resolve_model_path`;
    ``notify`` hears of anything slow a source does). Returns the problems, one line each starting
    with the key path."""
    named = list(_model_paths(data, ""))
    if not named:
        return []
    sources = installed_sources(host)
    problems: list[str] = []
    for parent, key, where in named:
        try:
            parent[key] = _resolved(parent[key], where, sources, host, notify)
        except ModelPathError as exc:
            problems.append(str(exc))
    return problems


def _model_paths(node: Any, where: str) -> Iterator[tuple[dict[str, Any], str, str]]:
    """``(mapping, key, key path)`` of every non-empty string under a key of :data:`PATH_KEYS` in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}.{key}" if where else str(key)
            if key in PATH_KEYS and isinstance(value, str):
                if value:
                    yield node, key, here
            else:
                yield from _model_paths(value, here)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _model_paths(value, f"{where}[{index}]")


def _resolved(
    path: str,
    where: str,
    sources: list[tuple[RegistryEntry, ModelSource]],
    host: PluginHost,
    notify: Notify | None,
) -> str:
    for entry, source in sources:
        words = who(entry)
        try:
            found = calling(words, f"resolving {where} {path!r}", source.resolve, path, notify)
        except PluginFault:
            raise
        except CoreRLError as exc:  # the source's one-line reason for a path it claims
            raise ModelPathError(f"{where}: {words}: {exc}") from exc
        if found is None:
            continue
        if not isinstance(found, str | os.PathLike):
            raise PluginFault(
                f"{words} returned {type(found).__name__} for {where} {path!r}; ModelSource.resolve returns "
                "the local directory (a str) or None"
            )
        return os.fspath(found)
    missing = _unclaimed_reader(path, host)
    if missing is not None:
        raise ModelPathError(f"{where}: no installed model source reads {path!r}; {missing}")
    return path


def _unclaimed_reader(path: str, host: PluginHost) -> str | None:
    """Why the source of this repository that reads ``path``'s kind of file (:data:`KNOWN_MODEL_FILES`)
    did not claim it: the host's message for a name it cannot load (not installed, with the extra
    that installs it; blocked; failing to load). ``None`` for any other path, and where that source
    is loaded (it declined the path: a file that is not there, for the preflight to report)."""
    name = KNOWN_MODEL_FILES.get(Path(path).suffix.lower())
    if name is None:
        return None
    try:
        host.get(MODEL_SOURCE, name)
    except PluginError as exc:
        return str(exc)
    return None
