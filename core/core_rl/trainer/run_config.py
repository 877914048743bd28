"""``<run>/config.yaml``: the fully resolved configuration a run trains with.

The main rank writes it (atomically) when the loop starts, as ``core-rl config show`` prints it:
every default, recipe setting, interpolation and override applied, so ``core-rl train
<run>/config.yaml`` runs the same configuration again. A resumed run whose configuration differs
from the one recorded keeps the earlier file as ``config.step<N>.yaml`` (``N``: the step it resumed
from; never overwritten) and reports each changed key (:func:`changed_keys`), leaving out the keys that only say how to
resume (``trainer.resume``, ``recover.*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from core_rl.checkpointing import write_text_atomic
from core_rl.config.loader import to_yaml
from core_rl.config.schema import RunConfig

CONFIG_FILE = "config.yaml"
#: keys whose change is how a run is resumed, not a change of what it trains
RESUME_KEYS = ("trainer.resume", "recover.")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key path -> value of the leaves of nested mappings (a list is one value)."""
    if not isinstance(data, Mapping) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``"key.path: old -> new"`` for each leaf that differs between two plain configurations
    (``(unset)`` where one has no such key), in key order, without :data:`RESUME_KEYS`."""
    old, new = _flat(before), _flat(after)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(RESUME_KEYS) or old.get(key, ...) == new.get(key, ...):
            continue
        a = repr(old[key]) if key in old else "(unset)"
        b = repr(new[key]) if key in new else "(unset)"
        lines.append(f"{key}: {a} -> {b}")
    return lines


def record_config(run_dir: Path, cfg: RunConfig, resumed_from: int | None) -> tuple[list[str], Path | None]:
    """Write ``cfg`` to ``run_dir/config.yaml``; when resuming (``resumed_from``: the step) over a
    recorded configuration that differs, keep that one first as ``config.step<N>.yaml`` (or
    ``config.step<N>-<k>.yaml`` when a resume from that step kept one already) and return
    :func:`changed_keys` with where it went (an unreadable earlier file is kept and reported as
    such); otherwise ``([], None)``."""
    path = run_dir / CONFIG_FILE
    text = to_yaml(cfg)
    changes: list[str] = []
    kept: Path | None = None
    if resumed_from and path.is_file():
        earlier = path.read_text(encoding="utf-8")
        if earlier != text:
            try:
                before = yaml.safe_load(earlier)  # both sides as YAML gives them back (tuples are lists)
                changes = changed_keys(before if isinstance(before, Mapping) else {}, yaml.safe_load(text))
            except yaml.YAMLError as exc:
                changes = [f"{path.name}: the earlier file does not parse ({exc.__class__.__name__})"]
            if changes:
                kept = run_dir / f"config.step{resumed_from}.yaml"
                k = 2
                while kept.exists():
                    kept, k = run_dir / f"config.step{resumed_from}-{k}.yaml", k + 1
                write_text_atomic(kept, earlier)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return changes, kept
