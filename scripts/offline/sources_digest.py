"""One digest of the sources core-rl's own wheels are built from (the root ``pyproject.toml``, ``core/``,
each plugin's ``pyproject.toml`` and ``src/``), so an install can tell a wheelhouse built from other
sources than the checkout beside it. Standard library only: it runs on the target machine too.

    python scripts/offline/sources_digest.py [CHECKOUT]      (default: this script's checkout)
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_PARTS = {"__pycache__"}


def source_files(root: Path) -> Iterator[Path]:
    """The files of ``root`` that core-rl's wheels are built from, in a fixed order."""
    roots = [root / "pyproject.toml", root / "core"]
    for project in sorted((root / "plugins").glob("*/*/pyproject.toml")):
        roots += [project, project.parent / "src"]
    for top in roots:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if not SKIPPED_PARTS & set(rel.parts) and path.suffix != ".pyc":
                yield path


def digest(root: Path) -> str:
    """sha256 over each source file's path (relative to ``root``) and contents."""
    total = hashlib.sha256()
    for path in source_files(root):
        total.update(path.relative_to(root).as_posix().encode() + b"\0")
        total.update(hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()


if __name__ == "__main__":
    print(digest(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
