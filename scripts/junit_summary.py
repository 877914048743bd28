"""Summarise a pytest JUnit XML file: totals, every failure and error with its last message line, and
the skips grouped by reason. Exit status 1 when anything failed or errored, else 0.

Usage: python scripts/junit_summary.py FILE.xml
       python scripts/junit_summary.py --passed-files FILE.xml   the test files every test of which passed
                                                               or skipped there, one per line (a suite cut
                                                               short by a machine's time limit goes on
                                                               without them: scripts/gpu_check.sh)
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def summarise(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:  # pytest was killed before it wrote the file, say
        print(f"   no test results: {path}: {exc}")
        return 1
    counts: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    skips: collections.Counter[str] = collections.Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                lines = (child.text or "").strip().splitlines()
                message = child.get("message") or (lines[-1] if lines else "")
                message = " ".join(message.split())
                problems.append(f"  {outcome.upper()} {name}: {message[:200]}")
            elif child.tag == "skipped":
                outcome = "skipped"
                skips[(child.get("message") or "").strip()[:160]] += 1
        counts[outcome] += 1
    print("   " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k]))
    for line in problems:
        print(line)
    if skips:
        print("   skipped, by reason:")
        for reason, n in skips.most_common():
            print(f"    {n:4d}  {reason}")
    return 1 if counts["failed"] or counts["error"] else 0


def test_file(classname: str, root: Path) -> str | None:
    """The file under ``root`` a JUnit ``classname`` (``plugins.engines.fsdp.tests.test_gpu.TestX``) comes from."""
    parts = [part for part in classname.split(".") if part]
    for end in range(len(parts), 0, -1):
        candidate = Path(*parts[: end - 1], parts[end - 1] + ".py")
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def passed_files(path: str, root: Path) -> list[str]:
    """The test files of ``path`` none of whose tests failed or errored (a collection error counts
    against its file)."""
    clean: dict[str, bool] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = test_file(case.get("classname") or "", root)
        if name is not None:
            failed = any(child.tag in ("failure", "error") for child in case)
            clean[name] = clean.get(name, True) and not failed
    return sorted(name for name, ok in clean.items() if ok)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--passed-files"]:
        print("\n".join(passed_files(sys.argv[2], Path.cwd())))
        sys.exit(0)
    sys.exit(summarise(sys.argv[1]))
