"""The ``gguf`` model source: a ``model_path`` / ``tokenizer_path`` naming a ``.gguf`` file becomes
the Hugging Face directory converted from it (:mod:`core_rl_gguf.conversion`, cached)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from core_rl.interfaces import ModelSource

from core_rl_gguf.conversion import ensure_converted, is_gguf


class GGUFSource(ModelSource):
    """Claims the paths of existing ``.gguf`` files (by suffix, any case). A ``.gguf`` path naming no
    file is left to the run's preflight, which reports it as it does a missing model directory (an
    example's run may write the file before training)."""

    def resolve(self, path: str, notify: Callable[[str], None] | None = None) -> str | None:
        """The converted directory of the GGUF file ``path`` (converted now, or found in the cache);
        ``None`` for any other path. Raises :class:`core_rl_gguf.conversion.GGUFError` where the file
        cannot be converted (the ``gguf`` package absent, a file transformers cannot read)."""
        if not is_gguf(path) or not Path(path).expanduser().is_file():
            return None
        return str(ensure_converted(path, notify))
