"""The lines a finished run prints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.config.schema import RunConfig


def summary_lines(cfg: RunConfig, result: Mapping[str, Any]) -> list[str]:
    """What a finished run prints: where its metrics, checkpoint and model are, its last evaluation,
    and the peak memory of its steps (:meth:`core_rl.loops.memory.MemoryMeter.summary`; a loop may not report one)."""
    at_end = str(cfg.saver.at_end).lower()
    none = f"none saved (saver.every_n_steps={cfg.saver.every_n_steps}, saver.at_end={at_end})"
    lines = [f"metrics:    {result['metrics']}", f"checkpoint: {result['checkpoint'] or none}"]
    lines += [result["best_checkpoint"]] if result.get("best_checkpoint") else []  # saver.keep_best
    if result["export"] is not None:
        lines.append(f"model:      {result['export']}")
    lines += [result["evaluation"]] if result.get("evaluation") else []  # the last eval: (eval/evaluator.py)
    return lines + ([result["peak_memory"]] if result.get("peak_memory") else [])
