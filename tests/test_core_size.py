"""scripts/core_size.py: the kinds of line of hand-counted sources, the core names a plugin imports,
and the table of a small repository of its own, from its working tree and from a commit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "core_size.py"


@pytest.fixture(scope="module")
def core_size():
    spec = importlib.util.spec_from_file_location("core_size", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["core_size"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("core_size", None)


SOURCE = '''"""A module docstring
over two lines."""

import os  # a comment after code is code

# a comment line


def f(x):
    """One docstring line."""
    text = """a string
    that is code"""
    return x, text, os


LIMIT = 3
"""An attribute's docstring."""
'''


def test_each_line_has_one_kind(core_size) -> None:
    kinds = core_size.line_kinds(SOURCE)
    # code: import, def, text = (2 lines), return, LIMIT; doc: 2 + 1 + 1; comment: 1; blank: 6
    assert dict(kinds) == {"code": 6, "doc": 4, "comment": 1, "blank": 6}
    assert sum(kinds.values()) == len(SOURCE.splitlines())


def test_the_core_names_a_source_imports(core_size) -> None:
    source = (
        "import os\nimport core_rl.ops\nfrom core_rl import errors\n"
        "from core_rl.interfaces import Reward, RolloutEngine as Engine\nfrom core_rl_hf import x\nfrom . import y\n"
    )
    assert sorted(core_size.core_imports(source)) == [
        ("core_rl", "errors"),
        ("core_rl.interfaces", "Reward"),
        ("core_rl.interfaces", "RolloutEngine"),
        ("core_rl.ops", ""),
    ]


def _write(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_the_table_of_a_repository_and_of_a_commit(tmp_path: Path, core_size, capsys) -> None:
    _write(
        tmp_path,
        {
            "core/core_rl/__init__.py": '"""The package."""\n',
            "core/core_rl/ops/maths.py": "X = 1\n\nY = 2\n",
            "core/core_rl/testing/kit.py": "# a kit\nZ = 3\n",
            "plugins/kits/train/src/kit_a/__init__.py": "from core_rl.ops.maths import X\n",
            "plugins/grpo/src/grpo/__init__.py": "from core_rl.ops.maths import X, Y\nimport core_rl\n",
            "plugins/grpo/tests/test_grpo.py": "from core_rl.testing.kit import Z\n",  # tests are not sources
        },
    )
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    _write(tmp_path, {"core/core_rl/ops/new.py": "A = 1\n"})  # untracked: the working tree only

    assert core_size.main(["--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["ops", "2", "4", "3", "0", "0", "1"]
    assert lines[3].split() == ["testing", "1", "2", "1", "0", "1", "0"]
    assert lines[4].split() == ["(top)", "1", "1", "0", "1", "0", "0"]
    assert lines[6].split() == ["all", "4", "7", "4", "1", "1", "1"]
    assert lines[7].split() == ["without", "testing", "3", "5", "3", "1", "0", "1"]
    assert lines[8] == "kits: 1 modules, 1 lines"
    assert lines[9] == "other plugins' sources: 1 modules, 2 lines"
    assert lines[10] == "plugins import 2 core names from 2 core modules:"
    assert lines[11:] == ["     2 core_rl.ops.maths", "     1 core_rl"]

    assert core_size.main(["--root", str(tmp_path), "--rev", "HEAD"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == ["ops", "1", "3", "2", "0", "0", "1"]

    assert core_size.main(["--root", str(tmp_path), "--rev", "no-such-commit"]) == 2
    assert "no-such-commit" in capsys.readouterr().err
