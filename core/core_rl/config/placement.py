"""The ``placement:`` section of a run: where each role runs, as the launcher is asked to place it.
Re-exported by :mod:`core_rl.config.schema`; checked against what a launcher offers by
:mod:`core_rl.launch.placement`.

Every trainer rank holds the actor and the other model roles (``ref``, ``critic``, ``teacher``,
``reward_model``): data parallelism over the actor's ranks. The rollout engine runs in rank 0 (the
``hf`` engine) or as inference servers (vLLM, SGLang), which the launcher places with the trainer
(``colocate``), on their own GPUs or nodes (``split``), or not at all: servers someone else started
(``external``, reached at ``rollout.engine.server.urls``)."""

from __future__ import annotations

import attrs

from core_rl.config.validators import MAX_COUNT, in_range, one_of

#: ``colocate``: rollout shares the trainer's GPUs (asleep while training); ``split``: rollout on
#: GPUs of its own; ``external``: servers already running, at ``rollout.engine.server.urls``;
#: ``auto`` (the default): ``external`` when those URLs are given, else ``colocate``
PLACEMENT_MODES = ("auto", "colocate", "split", "external")


@attrs.define
class RolePlacement:
    """What one role is given: ``gpus`` and ``cpus`` (cores) on each of ``nodes`` nodes. 0 GPUs:
    the role runs on CPUs; 0 CPUs: no cores reserved (the role's processes share the node's)."""

    gpus: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    cpus: int = attrs.field(default=0, validator=in_range(0, MAX_COUNT))
    nodes: int = attrs.field(default=1, validator=in_range(1, MAX_COUNT))

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.nodes

    @property
    def total_cpus(self) -> int:
        return self.cpus * self.nodes


@attrs.define
class PlacementConfig:
    """``mode`` (:data:`PLACEMENT_MODES`), the trainer's ranks (``actor``: one rank per GPU, or
    per CPU rank with ``gpus: 0``), the rollout servers (``rollout``) and, for the other model
    roles, null (they live in the trainer's ranks, which is the only placement the trainer runs
    today) or the actor's own placement written out."""

    mode: str = attrs.field(default="auto", validator=one_of(PLACEMENT_MODES))
    actor: RolePlacement = attrs.field(factory=RolePlacement)
    rollout: RolePlacement = attrs.field(factory=RolePlacement)
    ref: RolePlacement | None = None
    critic: RolePlacement | None = None
    teacher: RolePlacement | None = None
    reward_model: RolePlacement | None = None
