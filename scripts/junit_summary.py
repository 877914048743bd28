"""Summarise a pytest JUnit XML file: totals, every failure and error with its last message line, and
the skips grouped by reason. Exit status 1 when anything failed or errored, or the run was stopped
before its end (a deadline, Ctrl-C), else 0.

Usage: python scripts/junit_summary.py FILE.xml
       python scripts/junit_summary.py --passed-files FILE.xml   the test files every collected test of
                                                               which passed or skipped there, one per line
                                                               (collected.txt beside FILE.xml lists what
                                                               was collected; a suite cut short by a
                                                               machine's time limit goes on without them:
                                                               scripts/gpu_check.sh)
"""

from __future__ import annotations

import ast
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
    stopped = False  # a deadline's SIGINT (gpu_check.sh's SUITE_TIMEOUT) or Ctrl-C: no test's fault
    for case in root.iter("testcase"):
        if case.get("name") is None or is_interruption(case):  # what pytest writes for a test a stop cut off
            stopped = True
            continue
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
                reason = (child.get("message") or "").strip()
                if reason == "collection skipped":  # a module skipped whole: its reason is in the text
                    reason = f"collection skipped: {collection_skip_reason(child.text or '')}"
                skips[reason[:160]] += 1
        counts[outcome] += 1
    print("   " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts[k]))
    if stopped:
        print(f"   stopped before the end (a deadline or Ctrl-C){not_run(root, path)}")
    for line in problems:
        print(line)
    if skips:
        print("   skipped, by reason:")
        for reason, n in skips.most_common():
            print(f"    {n:4d}  {reason}")
    return 1 if counts["failed"] or counts["error"] or stopped else 0


def is_interruption(case: ET.Element) -> bool:
    """Whether ``case`` is pytest's record of the session itself stopped by ``KeyboardInterrupt``
    (its ``pytest::internal`` error, which pytest-xdist's controller writes when the interruption
    races its own shutdown; otherwise a stop leaves only a nameless ``testcase`` per test it cut off)."""
    if (case.get("classname"), case.get("name")) != ("pytest", "internal"):
        return False
    return any(child.tag == "error" and "KeyboardInterrupt" in (child.text or "") for child in case)


def not_run(root: ET.Element, path: str) -> str:
    """``": N of the M collected tests have no result"`` from ``collected.txt`` beside ``path``, or ``""``."""
    collected = Path(path).with_name("collected.txt")
    if not collected.is_file():
        return ""
    total = sum(1 for line in collected.read_text().splitlines() if line)
    recorded = sum(
        1 for case in root.iter("testcase") if case.get("name") and case.get("classname") not in ("", "pytest")
    )
    return f": {max(total - recorded, 0)} of the {total} collected tests have no result"


def collection_skip_reason(text: str) -> str:
    """The reason of a module skipped at collection, from pytest's ``(path, line, "Skipped: reason")``."""
    try:
        where = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()
    return str(where[-1]).removeprefix("Skipped: ") if isinstance(where, tuple) and where else text.strip()


def test_file(classname: str, root: Path) -> str | None:
    """The file under ``root`` a JUnit ``classname`` (``plugins.engines.fsdp.tests.test_gpu.TestX``) comes from."""
    parts = [part for part in classname.split(".") if part]
    for end in range(len(parts), 0, -1):
        candidate = Path(*parts[: end - 1], parts[end - 1] + ".py")
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def passed_files(path: str, collected: str, root: Path) -> list[str]:
    """The test files of ``path`` every collected test of which (``collected``: node ids, one per
    line, as the suite wrote them with ``CORE_RL_COLLECTED``) is in ``path`` and none failed or errored.
    A file the run was stopped in has fewer tests in ``path`` than it collected: not passed."""
    expected = collections.Counter(line.split("::", 1)[0] for line in Path(collected).read_text().splitlines() if line)
    seen: collections.Counter[str] = collections.Counter()
    failed: set[str] = set()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = test_file(case.get("classname") or "", root)
        if name is not None:
            seen[name] += 1
            if any(child.tag in ("failure", "error") for child in case):
                failed.add(name)
    return sorted(name for name, count in seen.items() if name not in failed and count == expected.get(name))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--passed-files"]:
        collected = Path(sys.argv[2]).with_name("collected.txt")
        if not collected.is_file():
            print(
                f"junit_summary: error: {collected} is missing: the suite writes it with CORE_RL_COLLECTED",
                file=sys.stderr,
            )
            sys.exit(2)
        try:
            print("\n".join(passed_files(sys.argv[2], str(collected), Path.cwd())))
        except (OSError, ET.ParseError) as exc:  # pytest was killed before it wrote the file, say
            print(f"junit_summary: error: {sys.argv[2]}: {exc}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    sys.exit(summarise(sys.argv[1]))
