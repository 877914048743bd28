"""The contract of a model source (:class:`ModelSource`): where the files of a ``model_path`` or
``tokenizer_path`` come from when the path is not a local Hugging Face directory or a hub id the
engines load themselves (a ``.gguf`` file converted once, a bucket, another hub); registered through
:func:`core_rl.hookspecs.core_rl_register_model_sources`, consulted by the configuration loader
(:mod:`core_rl.roles.model_sources`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable


class ModelSource(ABC):
    """Turns the model paths it handles into local Hugging Face directories.

    The configuration loader offers every non-empty ``model_path`` / ``tokenizer_path`` of a
    configuration (any role, any depth) to each installed source, by registered name, before the
    configuration is validated; the first source that answers with a directory wins and the path is
    replaced by it. Every source hears of every model path of every configuration loaded
    (``core-rl config validate`` included), so :meth:`resolve` decides cheaply, and without
    importing anything heavy (torch, transformers), that a path is not its own.
    """

    @abstractmethod
    def resolve(self, path: str, notify: Callable[[str], None] | None = None) -> str | None:
        """The local Hugging Face directory holding the model (or tokenizer) ``path`` names, for a path
        this source handles: fetched or converted now, or taken from where an earlier call left it
        (every rank of a run resolves the same paths; a source caches what it makes, under
        :func:`core_rl.roles.models_root` for instance, and makes it once when several processes ask at
        once). ``None`` for a path this source does not handle; the path then goes to the next source,
        and is kept as it is when no source claims it.

        ``notify`` (when given) receives one line for anything slow the call does (a download, a
        conversion), for the user to read while waiting.

        Raises :class:`core_rl.errors.CoreRLError` (or a subclass) with a one-line reason for a path
        this source handles but cannot make a directory of (a corrupt file, a missing optional
        package, a refused download): the loader reports it as a configuration problem naming the
        key path, this source and its distribution. Any other exception is a bug, reported as a
        :class:`~core_rl.errors.PluginFault` with its traceback."""
