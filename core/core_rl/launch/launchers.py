"""Launchers: how a run's processes start and where its roles are placed, a plugin kind like the
others (:func:`core_rl.hookspecs.core_rl_register_launchers`), selected by the ``launcher:``
section (``{name: local}`` by default; ``slurm``, ``ray`` or a site's own from plugins).

The interface:

- :meth:`Launcher.check`: what in the run's ``placement:`` the resources cannot hold, one line per
  problem naming the key path and the shortfall (most launchers return
  :func:`core_rl.launch.placement.placement_problems` for the resources they offer). ``core-rl config
  validate`` and ``core-rl train`` (before launching) report them and exit with status 2.
- :meth:`Launcher.offered` (optional): the resources for one launch, where its options change
  them; ``core-rl train`` checks ``check(cfg, offered(request))`` before it launches.
- :meth:`Launcher.launch`: start the run described by a :class:`LaunchRequest`, wait for it and
  return its exit status. Each trainer rank runs through :func:`core_rl.cli.run_rank`
  (given its rank, the world size and the rendezvous address), in whatever process the launcher
  starts (a torch elastic worker, an ``srun`` task, a Ray actor).

:func:`launch_checked` is what ``core-rl train`` does with a request.

The trainer never imports a launcher: launchers call the core, not the other way round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import attrs

from core_rl.launch.placement import ClusterResources

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

__all__ = ["ClusterResources", "LaunchRequest", "Launcher", "build_launcher", "launch_checked", "launcher_check"]


@attrs.define
class LaunchRequest:
    """What ``core-rl train`` asks a launcher to run.

    - ``config_path``, ``overrides``: the command's configuration file and ``KEY=VALUE`` overrides,
      exactly as given; each rank loads them again (:func:`core_rl.cli.run_rank`).
    - ``cfg``: the validated configuration they give (its ``launcher`` section is ``cfg.launcher``).
    - ``nproc_per_node``: ``--nproc-per-node`` (trainer ranks per node; ``None``: not given).
    - ``options``: the launcher options of ``core-rl train`` that plugins add
      (:func:`core_rl.hookspecs.core_rl_add_train_arguments`), by ``dest``, e.g.
      ``{"ray_address": None, "nnodes": 2}``; an option not given is ``None``.
    - ``host``: the plugin host that loaded ``cfg`` (a rank run in this process reuses it).
    """

    config_path: str
    overrides: list[str]
    cfg: RunConfig
    nproc_per_node: int | None = None
    options: dict[str, Any] = attrs.field(factory=dict)
    host: PluginHost | None = attrs.field(default=None, repr=False)


class Launcher(ABC):
    """Starts a run's processes (see the module docstring). ``factory(config)`` builds it from
    its validated ``launcher:`` section."""

    #: the name the launcher is registered under (messages use it)
    name: str = ""

    @abstractmethod
    def check(self, cfg: RunConfig, resources: ClusterResources | None) -> list[str]:
        """The problems of ``cfg``'s placement on ``resources`` (``None``: what this launcher offers,
        as it can tell without starting anything: this machine, the nodes its section asks for, a
        cluster it can reach). Each starts with a key path (``placement.rollout.gpus: ...``) and
        says what is needed and what is offered. Must not raise for a bad configuration."""

    def offered(self, request: LaunchRequest) -> ClusterResources | None:
        """What this launcher offers the run ``request`` describes, as ``core-rl train`` checks the
        placement before :meth:`launch` (``check(request.cfg, offered(request))``): where the
        launch options change it (``--nnodes``, a cluster's address); ``None`` (the default): as
        :meth:`check` judges without a request."""
        return None

    @abstractmethod
    def launch(self, request: LaunchRequest) -> int:
        """Run ``request`` to its end and return its exit status (0: success; 2: a user's mistake,
        reported as a message; 3: stopped by a signal after saving a checkpoint; else a failure).
        Every wait is bounded and names what it waited for."""


def build_launcher(cfg: RunConfig) -> Launcher:
    """The launcher ``cfg.launcher`` selects, built from its validated section."""
    launcher: Launcher = cfg.launcher.build()
    return launcher


def launch_checked(request: LaunchRequest) -> int:
    """Check the placement of ``request.cfg`` on what the selected launcher offers for it, then
    launch it; raise :class:`~core_rl.errors.ConfigError` (exit status 2) with the problems."""
    from core_rl.errors import ConfigError

    launcher = build_launcher(request.cfg)
    problems = launcher.check(request.cfg, launcher.offered(request))
    if problems:
        raise ConfigError(problems, source=request.config_path)
    return launcher.launch(request)


def launcher_check(cfg: RunConfig) -> list[str]:
    """The problems the selected launcher finds with the placement of ``cfg`` on what it offers
    (``core-rl config validate``, and ``core-rl train`` before it launches)."""
    return build_launcher(cfg).check(cfg, None)
