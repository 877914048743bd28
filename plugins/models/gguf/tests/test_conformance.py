"""The core's model-source conformance kit run against the ``gguf`` source: the real SmolLM2 GGUF file
(skipped where it cannot be had) becomes the same converted directory directly and through a
configuration, a corrupt ``.gguf`` file is one problem line naming the source, and everything else
(a Hugging Face directory, a hub id, a ``.gguf`` path naming no file) is turned down without
importing torch."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import core_rl_gguf.plugin
import pytest
from core_rl.testing import ModelSourceContract
from core_rl.testing import real_model as real


class TestGGUFSource(ModelSourceContract):
    plugin = core_rl_gguf.plugin
    name = "gguf"
    distribution = "core-rl-gguf"
    # a .gguf path naming no file is left to the run's preflight, as a missing model directory is
    unhandled_paths: ClassVar[list[str]] = [*ModelSourceContract.unhandled_paths, "models/absent.Q4_1.gguf"]

    def handled_path(self, tmp_path: Path) -> str | None:
        reason = real.unavailable()  # downloads and converts it once, where it can
        if reason is not None:
            pytest.skip(f"the real model {real.DESCRIPTION} is not available: {reason}")
        found = real.cached_gguf()
        assert found is not None
        return str(found)

    def unreadable_path(self, tmp_path: Path) -> str | None:
        broken = tmp_path / "broken.GGUF"  # the suffix in any case
        broken.write_bytes(b"not a gguf file at all")
        return str(broken)
