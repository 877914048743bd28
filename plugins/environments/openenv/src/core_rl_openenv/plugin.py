"""Registration of the ``openenv`` environment (entry point group ``core_rl.environments``). It
runs OpenEnv's client, and the local server if any, in a worker process of OpenEnv's own venv
(:mod:`core_rl_server_kit.worker`); the adapter it runs is :mod:`.adapter`.

.. code-block:: yaml

    rollout:
      workflow:
        name: environment
        environment:
          name: openenv
          environment: digit_game:DigitGame        # or url: http://host:port (a running server)
          action: digit_game:GuessAction
          observation: digit_game:GuessObservation
          python_path: [plugins/environments/openenv/examples]
          reset_keys: [seed]
          observation_field: text
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError
from core_rl.hookspecs import Register, hookimpl
from core_rl_server_kit.worker import LibraryEnvOptions, WorkerEnvironment, shared_worker

ADAPTER = Path(__file__).with_name("adapter.py")
#: OpenEnv's own venv, unless ``requirements`` says otherwise (uvicorn serves a local server)
REQUIREMENTS = ["openenv-core==0.3.*", "uvicorn>=0.30"]
KEY = "rollout.workflow.environment"


def _target(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and (":" not in value or not all(value.partition(":")[::2])):
        raise FieldValueError(attribute.name, value, "must be module:Name, e.g. digit_game:DigitGame")


@attrs.define
class OpenEnvConfig(LibraryEnvOptions):
    """The ``openenv`` section: either ``url`` (a running OpenEnv server) or ``environment``,
    ``action`` and ``observation`` (``module:Name`` of an OpenEnv ``Environment`` and its action and
    observation classes, served locally by openenv-core's ``create_app`` with ``max_sessions``
    concurrent sessions); ``action_field`` (the action's text field), ``observation_field`` (the
    observation's text field; empty: its fields as JSON), ``reset_keys`` (row columns passed to
    ``reset`` as keyword arguments), ``invalid_action_reward`` (an action the server refuses ends the
    episode with it), and the venv options of :class:`~core_rl_server_kit.worker.LibraryEnvOptions`
    (``requirements`` default ``openenv-core==0.3.*`` and uvicorn)."""

    url: str = ""
    environment: str = attrs.field(default="", validator=_target)
    action: str = attrs.field(default="", validator=_target)
    observation: str = attrs.field(default="", validator=_target)
    max_sessions: int = 64
    action_field: str = "message"
    observation_field: str = ""
    reset_keys: list[str] = attrs.field(factory=list)
    invalid_action_reward: float = 0.0
    requirements: list[str] = attrs.field(factory=lambda: list(REQUIREMENTS))

    def __attrs_post_init__(self) -> None:
        local = [self.environment, self.action, self.observation]
        if bool(self.url) == any(local) or (any(local) and not all(local)):
            raise FieldValueError(
                "url", self.url, "set either url (a running OpenEnv server) or all of environment, action, observation"
            )

    def adapter_options(self) -> dict[str, Any]:
        return attrs.asdict(self, filter=lambda a, _v: a.name not in attrs.fields_dict(LibraryEnvOptions))


def make_environment(config: OpenEnvConfig) -> WorkerEnvironment:
    """A trajectory in the worker of ``config`` (started, and its venv built, on first use)."""
    spec = config.worker_spec("openenv", "environment 'openenv'", KEY, ADAPTER, config.adapter_options())
    return WorkerEnvironment(shared_worker(spec))


@hookimpl
def core_rl_register_environments(register: Register) -> None:
    register(
        "openenv",
        make_environment,
        config_cls=OpenEnvConfig,
        description="an OpenEnv environment server (started locally, or by url) through OpenEnv's own client",
    )
