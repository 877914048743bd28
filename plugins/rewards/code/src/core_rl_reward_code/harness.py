"""Runs inside the sandbox: execute the solution, then each test in the solution's namespace, and
write ``{"passed": k, "total": n, "error": "..."}`` to the verdict descriptor.

Usage: ``python -I harness.py SOLUTION_FILE TESTS_JSON VERDICT_FD``. The solution runs with
``__name__ == "__solution__"``, so its ``if __name__ == "__main__":`` block does not run. A solution
that exits (``sys.exit``) fails every test; one that kills its own process writes no verdict and
fails too. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    solution_file, tests_file, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(tests_file, encoding="utf-8") as f:
        tests = json.load(f)
    with open(solution_file, encoding="utf-8") as f:
        source = f.read()
    namespace: dict[str, object] = {"__name__": "__solution__"}
    passed, error = 0, ""
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:
        error = f"solution: {type(exc).__name__}: {exc}"
    else:
        for i, test in enumerate(tests):
            try:
                exec(compile(test, f"test[{i}]", "exec"), namespace)
                passed += 1
            except BaseException as exc:
                error = error or f"test[{i}]: {type(exc).__name__}: {exc}"
    os.write(fd, json.dumps({"passed": passed, "total": len(tests), "error": error[:500]}).encode())


if __name__ == "__main__":
    main()
