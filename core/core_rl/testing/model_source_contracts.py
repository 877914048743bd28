"""Contract test class of model sources (see :mod:`core_rl.testing` and
:class:`core_rl.interfaces.ModelSource`).

A source's tests set ``plugin``, ``name`` and ``distribution``, and override :meth:`handled_path` (a
path the source makes a local directory of) and :meth:`unreadable_path` (a path it claims but cannot
read); the tests needing either skip where it returns ``None``. ``unhandled_paths`` lists paths the
source must turn down, besides a local Hugging Face directory (which every source turns down).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from core_rl.errors import CoreRLError
from core_rl.interfaces import ModelSource
from core_rl.plugins.components import build_component
from core_rl.plugins.kinds import MODEL_SOURCE
from core_rl.roles.model_sources import HOME_ENV, resolve_model_paths
from core_rl.testing.contracts import ComponentContract

#: what turning a path down must not import: every source hears of every model path of every
#: configuration loaded, and ``core-rl config validate`` imports neither
HEAVY_MODULES = ("torch", "transformers")

#: in a fresh interpreter: import the plugin module, build its source, turn down the paths, print
#: which heavy modules got imported
_TURN_DOWN = """
import importlib, json, sys
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import MODEL_SOURCE
module, name, paths, heavy = json.loads(sys.argv[1])
host = PluginHost(entry_points=[])
host.register_plugin(importlib.import_module(module), distribution="<contract>")
source = build_component(host.get(MODEL_SOURCE, name))
claimed = [path for path in paths if source.resolve(path, None) is not None]
print(json.dumps({"claimed": claimed, "imported": sorted(m for m in heavy if m in sys.modules)}))
"""


class ModelSourceContract(ComponentContract):
    """Override :meth:`handled_path` and :meth:`unreadable_path`; optionally set ``unhandled_paths``."""

    kind = MODEL_SOURCE
    unhandled_paths: ClassVar[list[str]] = ["Qwen/Qwen2.5-0.5B-Instruct", "models/no-such-model", "model.safetensors"]

    def handled_path(self, tmp_path: Path) -> str | None:
        """A path the source turns into a local Hugging Face directory (``None``: not tested)."""
        return None

    def unreadable_path(self, tmp_path: Path) -> str | None:
        """A path the source claims but cannot read, e.g. a corrupt file (``None``: not tested)."""
        return None

    def build(self) -> ModelSource:
        return build_component(self.entry())

    def test_registered_without_options(self) -> None:
        """Nothing in a configuration selects a model source, so no section would reach a config class."""
        assert self.entry().config_cls is None, "a model source is registered without config_cls"

    def test_a_local_directory_and_the_unhandled_paths_are_turned_down(self, tmp_path: Path) -> None:
        directory = tmp_path / "hf-model"
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        source = self.build()
        for path in [str(directory), *self.unhandled_paths]:
            assert source.resolve(path, None) is None, f"{self.name} claimed {path!r}, which is not its own"

    def test_turning_a_path_down_imports_nothing_heavy(self, tmp_path: Path) -> None:
        """The plugin module, building the source and turning down a path import neither torch nor
        transformers (checked in a fresh interpreter)."""
        if not isinstance(self.plugin, types.ModuleType) or importlib.util.find_spec(self.plugin.__name__) is None:
            pytest.skip("the plugin is no importable module: nothing to import afresh")
        paths = [str(tmp_path), *self.unhandled_paths]
        argument = json.dumps([self.plugin.__name__, self.name, paths, list(HEAVY_MODULES)])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run(
            [sys.executable, "-c", _TURN_DOWN, argument], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.splitlines()[-1])
        assert report["claimed"] == []
        assert report["imported"] == [], f"turning paths down imported {report['imported']}; import them when resolving"

    def test_a_handled_path_resolves_to_the_same_local_directory_every_time(self, tmp_path: Path) -> None:
        """Directly and as a configuration gets it: every ``model_path`` and ``tokenizer_path`` naming
        the path becomes the directory."""
        path = self.handled_path(tmp_path)
        if path is None:
            pytest.skip("no handled_path given")
        found = self.build().resolve(path, None)
        assert isinstance(found, str), f"ModelSource.resolve returns a str for a path it handles, got {found!r}"
        assert Path(found).is_dir() and any(Path(found).iterdir()), f"{found} is no directory holding a model"
        assert self.build().resolve(path, None) == found
        data = {"actor": {"model_path": path}, "critic": {"model_path": path, "tokenizer_path": path}}
        assert resolve_model_paths(data, self.host()) == []
        assert data == {"actor": {"model_path": found}, "critic": {"model_path": found, "tokenizer_path": found}}

    def test_a_path_it_cannot_read_is_one_problem_line_naming_the_source(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A :class:`CoreRLError` of one line, reported by the loader under the key path with the
        source's name and distribution. Run in a fresh ``$CORE_RL_HOME`` (whatever the source leaves
        in its cache stays out of the machine's)."""
        monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
        path = self.unreadable_path(tmp_path)
        if path is None:
            pytest.skip("no unreadable_path given")
        with pytest.raises(CoreRLError) as raised:
            self.build().resolve(path, None)
        reason = str(raised.value)
        assert reason and "\n" not in reason, f"the reason is one line, got {reason!r}"
        (problem,) = resolve_model_paths({"critic": {"model_path": path}}, self.host())
        assert problem.startswith(f"critic.model_path: {self.kind.label} {self.name!r} (distribution "), problem
        assert problem.endswith(reason)
