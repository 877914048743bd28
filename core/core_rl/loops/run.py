"""``train(cfg, host=...)``: a whole training run of the loop ``trainer.loop`` selects, checked
first and restarted after a crash as ``recover`` says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.config.epochs import derive_total_steps
from core_rl.config.schema import RunConfig
from core_rl.data.prompts import prompt_count
from core_rl.errors import PreflightError
from core_rl.launch.ranks import rank_and_world
from core_rl.loops.preflight import preflight
from core_rl.loops.summary import summary_lines
from core_rl.plugins.host import PluginHost
from core_rl.rollout.replay import coverage_problems


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Check the data, model, machine and output directory (:mod:`core_rl.loops.preflight`), derive
    ``trainer.total_steps`` from ``trainer.total_epochs`` when set (:mod:`core_rl.config.epochs`),
    then build the loop ``trainer.loop`` selects and run it, restarting after a crash as ``recover``
    says (:func:`core_rl.checkpoint.recover.run_with_restarts`); rank 0 prints the run's summary
    (:func:`core_rl.loops.summary.summary_lines`). Returns where the run's metrics, checkpoint and
    model are."""
    from core_rl.checkpoint.recover import run_with_restarts

    checked = preflight(cfg)
    # trainer.total_epochs: the steps follow from the prompts left after filtering (config/epochs.py)
    if cfg.trainer.total_epochs is not None:
        derive_total_steps(cfg, prompt_count(checked.rows, cfg.data, checked.tokenizer))
        if cfg.rollout.replay_from is not None and (missing := coverage_problems(cfg)):
            raise PreflightError(missing)
    result = run_with_restarts(cfg, host, data_rows=checked.rows)
    if rank_and_world()[0] == 0:
        print("\n".join(summary_lines(cfg, result)))
    return result
