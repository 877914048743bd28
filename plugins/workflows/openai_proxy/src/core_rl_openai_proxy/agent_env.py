"""The environment an agent script runs in (``rollout.workflow.python`` / ``requirements``).

``python``: that interpreter, as given (it must exist). ``requirements``: a venv holding them, built
once by :func:`core_rl_server_kit.env.create` (the machinery of ``core-rl server-env``: uv when
installed, pip's indexes passed on, a lock against concurrent builds, a manifest marking it
finished) and reused while the requirements and the base interpreter's version are the same; it
lives under ``$CORE_RL_HOME/server-envs/agent-cpu-<hash>`` (``core-rl server-env list`` shows it,
``core-rl server-env remove agent`` removes it). core-rl's own environment is never changed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from core_rl.errors import ConfigError
from core_rl.interfaces.servers import ServerEnvError, ServerEnvSpec
from core_rl_server_kit.env import create, env_python

#: the name of the built environments (``core-rl server-env list``)
ENV_NAME = "agent"


#: the build's last step: the bytecode of every installed module, written once. A script runs once
#: per episode, and where ``PYTHONDONTWRITEBYTECODE`` is set no run would write it, so each would
#: compile what it imports again (openai-agents and its dependencies: about half its start-up)
COMPILE = (
    "import compileall, site, sys; "
    "sys.exit(not all(compileall.compile_dir(d, quiet=1, workers=0) for d in site.getsitepackages()))"
)


def agent_env_spec(requirements: Sequence[str]) -> ServerEnvSpec:
    """The environment of ``requirements``: a venv, one ``pip install`` of them and their
    bytecode compiled (its hash, and so its directory, changes with them)."""
    steps = [["-m", "pip", "install", *requirements], ["-c", COMPILE]]
    return ServerEnvSpec(
        name=ENV_NAME,
        steps={"cpu": steps, "cuda": steps},
        description="an agent script's environment (rollout.workflow.requirements)",
    )


def agent_python(python: str, requirements: Sequence[str]) -> str:
    """The interpreter of a script program: ``python`` (checked to exist), else that of the
    environment built from ``requirements``, else core-rl's own. A failed build is a config error
    naming the key and the build log."""
    if python:
        path = Path(python).expanduser()
        if not path.is_file():
            raise ConfigError(
                [f"rollout.workflow.python: no interpreter at {python!r}; give the path of a Python executable"]
            )
        return str(path)
    if not requirements:
        return sys.executable
    try:
        directory = create(agent_env_spec(requirements), variant="cpu", echo=lambda line: print(line, flush=True))
    except ServerEnvError as exc:
        raise ConfigError(
            [f"rollout.workflow.requirements: the agent's environment could not be built: {exc}"]
        ) from exc
    return str(env_python(directory))
