"""Build the training loop a configuration selects (``trainer.loop``, a ``core_rl.loops`` plugin)."""

from __future__ import annotations

from core_rl.config.schema import RunConfig
from core_rl.data.prompts import DataRow
from core_rl.interfaces import TrainingLoop
from core_rl.loops.signals import StopSignals
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LOOP


def build_loop(
    cfg: RunConfig, host: PluginHost, *, stop: StopSignals, data_rows: list[DataRow] | None = None
) -> TrainingLoop:
    """The loop of ``cfg.trainer.loop``, built by its factory with the loop's validated section
    (:func:`core_rl.plugins.components.build_component`)."""
    spec = cfg.trainer.loop
    entry = spec.entry if spec.entry is not None else host.get(LOOP, spec.name)
    return build_component(entry, cfg, host, stop=stop, data_rows=data_rows, config=spec.config)
