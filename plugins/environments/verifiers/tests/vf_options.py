"""The options the verifiers plugin's tests share: the example tasksets' directory on the worker's
path, and verifiers' venv built from the plugin's default requirements (once per machine, cached
under ``$CORE_RL_HOME/server-envs/verifiers-cpu-<hash>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def options(taskset: str, **more: Any) -> dict[str, Any]:
    """A ``verifiers`` section (without ``name``) for one of the example tasksets."""
    return {"taskset": taskset, "python_path": [EXAMPLES], **more}
