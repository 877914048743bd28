"""``<run>/config.yaml``: the configuration a run trains with.

The main rank writes it (atomically) when the loop starts, as ``core-rl config show`` prints it
(:func:`core_rl.config.loader.to_yaml`): every default, recipe setting and override applied, and
each key derived from others (:mod:`core_rl.config.derived`: the schedules' ``total_steps``, a
plugin's ``default_from`` fields, ``${...}`` interpolations) kept derived, with its value in a
comment. So ``core-rl train <run>/config.yaml`` runs the same configuration again, and
``core-rl train <run>/config.yaml recover.mode=resume trainer.total_steps=20`` extends the run
with every value derived from ``trainer.total_steps`` derived anew. A setting chosen from the
machine at the start (``max_tokens_per_mb: auto``) is recorded as ``auto`` with the value this run
chose in a comment.

A resumed run whose configuration differs from the one recorded keeps the earlier file as
``config.step<N>.yaml`` (``N``: the step it resumed from; never overwritten) and reports
(:func:`resume_note`) each changed setting (:func:`changed_keys`), leaving out the keys that only
say how to resume (``trainer.resume``, ``recover.*``), and each derived value recomputed from
them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from core_rl.checkpoint.atomic import write_text_atomic
from core_rl.config.derived import INTERPOLATION, Derived
from core_rl.config.loader import load_config, to_yaml
from core_rl.config.paths import node_at, replace_at
from core_rl.config.schema import RunConfig
from core_rl.errors import CoreRLError
from core_rl.plugins.host import PluginHost

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


def _differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, "key: old -> new")`` for each leaf that differs, in key order, without :data:`RESUME_KEYS`."""
    old, new = _flat(before), _flat(after)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(RESUME_KEYS) or old.get(key, ...) == new.get(key, ...):
            continue
        a = repr(old[key]) if key in old else "(unset)"
        b = repr(new[key]) if key in new else "(unset)"
        lines.append((key, f"{key}: {a} -> {b}"))
    return lines


def changed_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``"key.path: old -> new"`` for each leaf that differs between two plain configurations
    (``(unset)`` where one has no such key), in key order, without :data:`RESUME_KEYS`."""
    return [line for _key, line in _differences(before, after)]


@attrs.frozen
class Recorded:
    """What :func:`record_config` found: the settings changed since the recorded configuration
    (``changes``, ``"key: old -> new"``), the derived values recomputed from them
    (``recomputed``, the same with how each is derived), and where the earlier file was kept."""

    changes: list[str] = attrs.field(factory=list)
    recomputed: list[str] = attrs.field(factory=list)
    kept: Path | None = None


def _with_values(written: Any, derived: Mapping[str, Derived]) -> Any:
    """Plain configuration data as written, each derived key replaced by its value."""
    data = json.loads(json.dumps(written))
    for d in derived.values():
        replace_at(data, d.path, json.loads(json.dumps(d.value)))
    return data


def _earlier_derived(path: Path, host: PluginHost | None) -> dict[str, Derived]:
    """The derived keys of the recorded configuration at ``path`` (none when it does not load)."""
    if host is None:
        return {}
    try:
        return load_config(path, host=host, require_complete=False, notify=lambda _note: None).derived
    except CoreRLError:
        return {}


def _compare(earlier: str, path: Path, cfg: RunConfig, text: str, host: PluginHost | None) -> Recorded:
    """Compare the recorded configuration (text ``earlier`` of ``path``) with ``cfg`` (``text``)."""
    try:
        before_written, after_written = yaml.safe_load(earlier), yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return Recorded(changes=[f"{path.name}: the earlier file does not parse ({exc.__class__.__name__})"])
    if not isinstance(before_written, Mapping):
        before_written = {}
    # a value chosen at the start (from the machine, or the data's size) is chosen anew on resume:
    # as written (auto, or 0) both
    earlier_derived = {k: d for k, d in _earlier_derived(path, host).items() if not d.at_start}
    before = _with_values(before_written, earlier_derived)
    after = _with_values(after_written, {k: d for k, d in cfg.derived.items() if not d.at_start})
    changes, recomputed = [], []
    for key, line in _differences(before, after):
        d = cfg.derived.get(key)
        if d is not None and node_at(before_written, d.path) == node_at(after_written, d.path):
            how = f"interpolation {d.written}" if d.source == INTERPOLATION else d.source
            recomputed.append(f"{line} ({how})")
        else:
            changes.append(line)
    return Recorded(changes, recomputed)


def record_config(
    run_dir: Path, cfg: RunConfig, resumed_from: int | None, *, host: PluginHost | None = None
) -> Recorded:
    """Write ``cfg`` to ``run_dir/config.yaml``; when resuming (``resumed_from``: the step) over a
    recorded configuration that differs, keep that one first as ``config.step<N>.yaml`` (or
    ``config.step<N>-<k>.yaml`` when a resume from that step kept one already) and return the
    changed settings and recomputed derived values (the earlier derived values come from loading
    the earlier file with ``host``'s plugins; without ``host`` derived keys compare as written);
    an unreadable earlier file is kept and reported as such. Otherwise an empty :class:`Recorded`."""
    path = run_dir / CONFIG_FILE
    text = to_yaml(cfg)
    found = Recorded()
    if resumed_from and path.is_file():
        earlier = path.read_text(encoding="utf-8")
        if earlier != text:
            found = _compare(earlier, path, cfg, text, host)
            if found.changes or found.recomputed:
                kept = run_dir / f"config.step{resumed_from}.yaml"
                k = 2
                while kept.exists():
                    kept, k = run_dir / f"config.step{resumed_from}-{k}.yaml", k + 1
                write_text_atomic(kept, earlier)
                found = attrs.evolve(found, kept=kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return found


def resume_note(found: Recorded, step: int | None) -> str | None:
    """The note a run resumed from ``step`` prints about what :func:`record_config` found, or
    ``None`` when nothing changed."""
    if not (found.changes or found.recomputed):
        return None
    parts = [f"{len(found.changes)} setting(s) changed"] if found.changes else []
    if found.recomputed:
        parts.append(f"{len(found.recomputed)} derived value(s) recomputed" + (" from them" if found.changes else ""))
    lines = [*found.changes, *found.recomputed]
    return (
        f"resumed from step {step} with {' and '.join(parts)} since the checkpoint's run (its configuration is "
        f"kept as {found.kept}):\n  " + "\n  ".join(lines)
    )
