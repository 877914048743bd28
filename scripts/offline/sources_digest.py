"""One digest of the sources core-rl's own wheels are built from (the root ``pyproject.toml``, ``core/``,
each plugin's ``pyproject.toml`` and ``src/``), so an install can tell a wheelhouse built from other
sources than the checkout beside it. Standard library only: it runs on the target machine too.

    python scripts/offline/sources_digest.py [CHECKOUT]      (default: this script's checkout)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_files(root: Path) -> Iterator[Path]:
    """The files of ``root`` that core-rl's wheels are built from, in a fixed order: those git does not
    ignore where ``root`` is a git checkout (as the wheels leave ignored files out), else every file
    but compiled bytecode and packaging metadata (a copy of a checkout holds no ignored files but those)."""
    listed = _git_files(root)
    folders = [name for name in listed or () if name.endswith("/")]  # a nested repository, listed whole
    roots = [root / "pyproject.toml", root / "core"]
    for project in sorted((root / "plugins").glob("*/*/pyproject.toml")):
        roots += [project, project.parent / "src"]
    for top in roots:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(root)
            if listed is not None:
                inside = any(rel.as_posix().startswith(folder) for folder in folders) and _kept_by_walk(rel, path)
                if rel.as_posix() in listed or inside:
                    yield path
            elif _kept_by_walk(rel, path):
                yield path


def _kept_by_walk(rel: Path, path: Path) -> bool:
    """Whether a walk counts a file: not compiled bytecode, not packaging metadata."""
    return (
        "__pycache__" not in rel.parts
        and path.suffix != ".pyc"
        and not any(part.endswith(".egg-info") for part in rel.parts)
    )


def _git_files(root: Path) -> set[str] | None:
    """The files of ``root``'s git checkout that git does not ignore (tracked, or untracked and not
    ignored); ``None`` where ``root`` is no git checkout or git is not at hand."""
    if not (root / ".git").exists():
        return None
    command = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    try:
        proc = subprocess.run([*command, "--", "pyproject.toml", "core", "plugins"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return {name for name in proc.stdout.decode().split("\0") if name}


def digest(root: Path) -> str:
    """sha256 over each source file's path (relative to ``root``) and contents."""
    total = hashlib.sha256()
    for path in source_files(root):
        total.update(path.relative_to(root).as_posix().encode() + b"\0")
        total.update(hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()


if __name__ == "__main__":
    print(digest(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
