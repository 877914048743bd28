"""``rollout.sync_check``: after a weight sync, check that the rollout engine holds the weights the
trainer sent (:mod:`core_rl.sync.check`)."""

from __future__ import annotations

import attrs

from core_rl.config.validators import MAX_STEPS, in_range


@attrs.define
class SyncCheckConfig:
    """``enabled``: check after weight syncs (default on); ``every_n_syncs``: check the ``N``-th,
    ``2N``-th, ... sync of the run (1: every one). A mismatch stops the run at that step."""

    enabled: bool = True
    every_n_syncs: int = attrs.field(default=1, validator=in_range(1, MAX_STEPS))
