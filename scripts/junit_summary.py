"""Summarise a pytest JUnit XML file: totals, every failure and error with its last message line, and
the skips grouped by reason. Exit status 1 when anything failed or errored, else 0.

Usage: python scripts/junit_summary.py FILE.xml
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


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


if __name__ == "__main__":
    sys.exit(summarise(sys.argv[1]))
