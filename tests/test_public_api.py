"""The SDK boundary: every in-repo plugin, both kits, the examples and the example third-party plugin
import only core-rl's public surface (:mod:`core_rl.testing.public_api`); each public package's
``__all__`` resolves; the check itself catches an import past the surface; the old module paths of
the layout before the concept folders still import, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from core_rl.testing.public_api import PUBLIC_MODULES, PUBLIC_PACKAGES, private_imports

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    plugins = sorted(p for p in ROOT.glob("plugins/*/*/src") if p.is_dir())
    return [*plugins, ROOT / "examples"]


@pytest.mark.parametrize("source", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_examples_import_only_the_public_surface(source: Path) -> None:
    files = [f for f in source.rglob("*.py") if "tests" not in f.relative_to(source).parts]
    problems = [line for f in files for line in private_imports(f)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_an_import_past_the_surface_is_named_with_where_to_import_it_from(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "from core_rl.loops.supervised.loop import SupervisedLoop\n"  # internal module of a public package
        "from core_rl.loops.supervised import SupervisedLoop as Base\n"  # the public way
        "from core_rl.plugins import ALL_KINDS_NOT_EXPORTED\n"  # a name the package does not export
        "import core_rl.loops.rl.update\n"  # internal, no public package above it but core_rl.loops
        "from core_rl.interfaces.engines import TrainEngine\n"  # a public tree
        "import torch\n"
    )
    assert private_imports(plugin) == [
        f"{plugin}:1: core_rl.loops.supervised.loop is internal to core-rl; import it from core_rl.loops.supervised",
        f"{plugin}:3: 'ALL_KINDS_NOT_EXPORTED' is not in core_rl.plugins.__all__",
        f"{plugin}:4: core_rl.loops.rl.update is internal to core-rl; import it from core_rl.loops",
    ]


def test_an_old_module_path_imports_with_a_deprecation_warning_naming_the_new_one() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    from core_rl.trainer.supervised import SupervisedLoop\n"
        "except DeprecationWarning as w:\n"
        "    print(w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from core_rl.trainer.supervised import SupervisedLoop\n"
        "from core_rl.loops.supervised import SupervisedLoop as New\n"
        "from core_rl.environments import Environment\n"
        "from core_rl.interfaces import Environment as Contract\n"
        "print(SupervisedLoop is New, Environment is Contract)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [
        "core_rl.trainer moved to core_rl.loops; the old path goes in the next release",
        "True True",
    ]


def test_the_architecture_page_lists_every_folder_of_the_core() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^  ([a-z_]+)/ ", page, re.M)) | {
        m.split("/")[0] for m in re.findall(r"^  ([a-z_]+/[a-z_]+)/ ", page, re.M)
    }
    folders = {p.name for p in (ROOT / "core" / "core_rl").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert listed == folders


def test_every_moved_path_imports_as_its_replacement() -> None:
    """Each old path of :data:`core_rl.plugins.moved_modules.MOVED` imports (with its warning) and
    holds its replacement's names, the same objects: a third party's old import keeps working (an old
    package's submodules are its own, so that they never rebind the new package's)."""
    code = (
        "import importlib, inspect, json, warnings\n"
        "import core_rl\n"
        "from core_rl.plugins.moved_modules import MOVED\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "wrong = []\n"
        "for old, new in MOVED.items():\n"
        "    before, after = importlib.import_module(old), importlib.import_module(new)\n"
        "    names = [n for n, v in vars(after).items() if not n.startswith('_') and not inspect.ismodule(v)]\n"
        "    if any(getattr(before, n, None) is not getattr(after, n) for n in names):\n"
        "        wrong.append(old)\n"
        "print(json.dumps([len(MOVED), wrong]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    count, wrong = json.loads(out.splitlines()[-1])
    assert count > 80 and wrong == []
