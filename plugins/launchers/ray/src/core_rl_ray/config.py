"""The ``launcher`` section of a run with ``launcher.name: ray`` (:class:`RayLauncherConfig`)."""

from __future__ import annotations

import attrs
from core_rl.config.validators import non_negative, one_of, positive

from core_rl_ray.placement import STRATEGIES


@attrs.define
class RayLauncherConfig:
    """Where and how a run is placed on Ray.

    - ``address``: the head of a running cluster (``host:port``, or ``auto`` for the cluster
      ``ray start`` started on this machine); ``core-rl train --ray-address`` overrides it. Empty:
      a cluster is started on this machine (127.0.0.1) for the run and shut down after it.
    - ``local_cpus``: CPUs of that local cluster (0: all of this machine's).
    - ``strategy``: the placement group's (``STRICT_PACK``, ``PACK``, ``SPREAD``,
      ``STRICT_SPREAD``); empty: chosen from ``placement`` (see :mod:`core_rl_ray.placement`).
    - ``placement_timeout_s``: how long to wait for the cluster to hold every bundle.
    - ``actor_timeout_s``: how long one call to an actor may take; an actor that does not answer
      in time is taken as lost with its node.
    - ``stop_grace_s``: after a failure or a stop signal, how long the other ranks have to finish
      their step and save a checkpoint before they are killed.
    - ``poll_s``: how often the actors are asked whether they still run.
    - ``env``: environment variables for every trainer rank.
    """

    address: str = ""
    local_cpus: int = attrs.field(default=0, validator=non_negative())
    strategy: str = attrs.field(default="", validator=one_of(("", *STRATEGIES)))
    placement_timeout_s: float = attrs.field(default=120.0, validator=positive())
    actor_timeout_s: float = attrs.field(default=60.0, validator=positive())
    stop_grace_s: float = attrs.field(default=120.0, validator=positive())
    poll_s: float = attrs.field(default=0.5, validator=positive())
    env: dict[str, str] = attrs.field(factory=dict)
