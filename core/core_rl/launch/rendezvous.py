"""One trainer rank, started by any launcher: :func:`core_rl.cli.run_rank` with an explicit
:class:`Rendezvous` (rank, world size and the address of rank 0's process-group store).

Under torch's elastic agent (the ``local`` launcher, ``torchrun``, an ``srun`` task running
``torchrun``) the agent sets these variables and runs ``core-rl train``, which trains in its own
process when they are set; a launcher that starts ranks itself (e.g. inside Ray actors) calls
:func:`core_rl.cli.run_rank` in each rank's process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

#: the variables a rank reads (``env://`` initialisation of the default process group)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@attrs.frozen
class Rendezvous:
    """Where one rank stands: ``rank`` of ``world_size``, ``local_rank`` of the
    ``local_world_size`` ranks on its node, and rank 0's store at ``master_addr:master_port``
    (rank 0 listens there; every other rank connects)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size {self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_rank {self.local_rank} of local_world_size {self.local_world_size} does not fit world_size "
                f"{self.world_size}"
            )

    def env(self) -> dict[str, str]:
        """The environment variables of :data:`RANK_VARIABLES` for this rank."""
        values = attrs.astuple(self)
        return dict(zip(RANK_VARIABLES, map(str, values), strict=True))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Rendezvous | None:
        """The rendezvous the environment describes (as torch's elastic agent sets it), or ``None``
        when ``RANK`` is not set (not a launched rank)."""
        env = os.environ if environ is None else environ
        if "RANK" not in env:
            return None
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )


def apply(rendezvous: Rendezvous, environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``rendezvous``'s variables in ``environ`` (default: this process's), and point gloo and
    NCCL at the loopback interface when rank 0 is on this machine and the user chose none."""
    from core_rl.launch.ranks import listen_on_loopback_unless_configured

    (os.environ if environ is None else environ).update(rendezvous.env())
    listen_on_loopback_unless_configured(rendezvous.master_addr)


def train_in_process(cfg: RunConfig, host: PluginHost) -> int:
    """Train ``cfg`` in this process (one rank: of a launched run when the rank variables are set,
    else the whole run) and return 0; errors propagate as the trainer raises them."""
    from core_rl.launch.distributed import destroy_process_group_at_exit
    from core_rl.loops import train

    train(cfg, host=host)
    destroy_process_group_at_exit()
    return 0
