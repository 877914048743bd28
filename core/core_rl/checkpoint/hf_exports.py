"""Hugging Face exports during a run (``saver.export_hf_every_n_steps``): the policy of step ``N``
written to ``<run>/hf/step_<N>`` (8 digits), each atomically by the engine's ``export_hf``, the
newest ``saver.export_hf_keep_last`` kept (0: all). An export is a directory
``AutoModelForCausalLM.from_pretrained`` loads (with the tokenizer), for evaluation or serving
while training goes on; ``final_hf`` at the end is unaffected."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from core_rl.config.schema import SaverConfig
from core_rl.launch.ranks import waiting_for

_STEP = re.compile(r"step_(\d{8})")


def export_dir(run_dir: Path, step: int, folder: str = "hf") -> Path:
    """``<run>/<folder>/step_<N>`` (``hf``: these exports; ``reference``:
    :mod:`core_rl.loops.rl.reference_reset`'s)."""
    return run_dir / folder / f"step_{step:08d}"


def exported_steps(run_dir: Path, folder: str = "hf") -> list[int]:
    """The steps of the finished exports in ``<run>/<folder>``, oldest first (partial directories,
    whose names start with a dot, are not exports)."""
    path = run_dir / folder
    if not path.is_dir():
        return []
    return sorted(int(m[1]) for p in path.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir())


def prune_exports(run_dir: Path, keep_last: int) -> list[int]:
    """Remove all but the newest ``keep_last`` exports (none with 0); return the steps removed."""
    steps = exported_steps(run_dir)
    removed = steps[:-keep_last] if keep_last else []
    for step in removed:
        shutil.rmtree(export_dir(run_dir, step), ignore_errors=True)
    return removed


def export_due(saver: SaverConfig, step: int) -> bool:
    return bool(saver.export_hf_every_n_steps) and step % saver.export_hf_every_n_steps == 0


def export_step(engine: Any, saver: SaverConfig, run_dir: Path, step: int, *, is_main: bool) -> Path:
    """Export the policy of ``step`` (collective: every rank calls it) and, on the main rank, prune."""
    path = export_dir(run_dir, step)
    with waiting_for(f"the other ranks to export the model of step {step}"):
        engine.export_hf(path)
    if is_main:
        prune_exports(run_dir, saver.export_hf_keep_last)
    return path
