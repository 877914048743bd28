"""The interpreter an agent program runs with (``rollout.workflow.python`` / ``requirements``).

``python``: that interpreter, as given (it must exist). ``requirements``: a venv holding them, built
once by the server kit's library environments (:func:`core_rl_server_kit.worker.library_python`:
the machinery of ``core-rl server-env``, uv when installed, pip's indexes passed on, a lock against
concurrent builds, the bytecode compiled at build time so no episode compiles the agent's libraries
again) and reused while the requirements and the base interpreter's version are the same; it lives
under ``$CORE_RL_HOME/server-envs/agent-cpu-<hash>`` (``core-rl server-env list`` shows it,
``core-rl server-env remove agent`` removes it). core-rl's own environment is never changed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from core_rl_server_kit.worker import library_python

#: the name of the built environments (``core-rl server-env list``)
ENV_NAME = "agent"


def agent_python(python: str, requirements: Sequence[str]) -> str:
    """The interpreter of the program: ``python`` (checked to exist), else that of the environment
    built from ``requirements``, else core-rl's own. A missing interpreter or a failed build is a
    config error naming the key."""
    if not python and not requirements:
        return sys.executable
    return library_python(ENV_NAME, python, requirements, "rollout.workflow")
