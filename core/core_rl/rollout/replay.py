"""Training on saved rollouts (``rollout.replay_from``): step ``N`` of a replay run trains on the
generation batches of ``<replay_from>/step_<N:08d>.parquet`` (:mod:`core_rl.rollout.dump`)
instead of generating and scoring; no rollout engine is built and no reward is called.

From the saved samples and raw rewards the step recomputes what the original step did: the sample
filters, reward shaping, advantages and loss masks, then the update as the configuration says
(``algorithm.recompute_logprob``, a loss's ``requires_recompute``: the old log-probs are recomputed
by the train engine, else the saved behaviour log-probs are used, as in the original run). Same
configuration and train engine: the same weights, bitwise; another micro-batch budget or engine:
the same data, so the differences are the engine's.

Checked before any model is loaded (:func:`replay_problems`, exit status 2): the directory exists,
holds a readable step file for each of steps ``1..trainer.total_steps``, written with the same
tokenizer (vocabulary fingerprint) and token ids inside the model's vocabulary. A configuration that
differs from the dumping run's in sections that shape training is only noted on stderr (comparing
micro-batch budgets or engines is what replay is for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from core_rl.config.schema import RunConfig
from core_rl.errors import CoreRLError, stderr_line
from core_rl.loops.rl.batching import Generation
from core_rl.rollout.dump import (
    FORMAT_VERSION,
    config_hashes,
    dumped_steps,
    read_header,
    read_step,
    step_file,
    tokenizer_identity,
)

KEY = "rollout.replay_from"
#: metrics of the dumping run's generation batches that describe its clock, not the data
CLOCK_PREFIXES = ("timing/", "throughput/")


def _ranges(steps: Iterable[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out: list[list[int]] = []
    for s in sorted(steps):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def coverage_problems(cfg: RunConfig) -> list[str]:
    """The steps ``1..trainer.total_steps`` without a complete step file under ``rollout.replay_from``."""
    assert cfg.rollout.replay_from is not None
    root, total_steps = Path(cfg.rollout.replay_from), cfg.trainer.total_steps
    if not root.is_dir():
        return []  # said by replay_problems
    missing = set(range(1, total_steps + 1)) - set(dumped_steps(root))
    if not missing:
        return []
    return [
        f"{KEY}: {root} holds no dump of step(s) {_ranges(missing)} of the {total_steps} this run trains "
        f"(trainer.total_steps); lower trainer.total_steps to {min(missing) - 1}, or replay a run that dumped "
        "every step (rollout.dump.every_n_steps: 1)"
    ]


def replay_problems(cfg: RunConfig, tokenizer: Any, vocab_size: int | None) -> list[str]:
    """Every problem of ``rollout.replay_from`` against this run's tokenizer and model vocabulary
    (the step coverage only when ``trainer.total_steps`` is known: else :func:`coverage_problems`
    once it is derived), one line each naming the key."""
    assert cfg.rollout.replay_from is not None
    root = Path(cfg.rollout.replay_from)
    if not root.is_dir():
        return [
            f"{KEY}: {root} is not a directory; name the rollouts directory of a run that dumped them "
            "(rollout.dump.every_n_steps > 0; by default <run>/rollouts)"
        ]
    total = cfg.trainer.total_steps if cfg.trainer.total_epochs is None else None
    problems = coverage_problems(cfg) if total else []
    steps = dumped_steps(root)
    if not steps:
        return problems or [f"{KEY}: {root} holds no step_<N>.parquet rollout dumps; dump them with rollout.dump"]
    headers: dict[int, dict[str, Any]] = {}
    for step, path in sorted(steps.items()):
        if total and step > total:
            continue
        try:
            headers[step] = read_header(path)
        except Exception as exc:  # pyarrow raises its own error kinds for a damaged file
            problems.append(f"{KEY}: {path} is not a readable core-rl rollout dump ({exc}); dump the step again")
    newer = [s for s, h in headers.items() if h.get("format_version", 0) > FORMAT_VERSION]
    if newer:
        problems.append(
            f"{KEY}: step(s) {_ranges(newer)} under {root} were written by a newer core-rl (format version "
            f"{headers[newer[0]]['format_version']}, this one reads {FORMAT_VERSION}); replay them with that version"
        )
    if tokenizer is not None and headers:
        ours = tokenizer_identity(tokenizer)
        other = {s for s, h in headers.items() if h["tokenizer"]["fingerprint"] != ours["fingerprint"]}
        if other:
            theirs = headers[min(other)]["tokenizer"]
            key = "actor.tokenizer_path" if cfg.actor.tokenizer_path else "actor.model_path"
            problems.append(
                f"{KEY}: step(s) {_ranges(other)} under {root} were generated with another tokenizer "
                f"({theirs['name_or_path']}, {theirs['vocab_size']} tokens, fingerprint {theirs['fingerprint']}) "
                f"than this run's {key} ({ours['name_or_path']}, {ours['vocab_size']} tokens, fingerprint "
                f"{ours['fingerprint']}); set {key} to the tokenizer that generated them"
            )
    if vocab_size is not None:
        outside = {s for s, h in headers.items() if h.get("max_token_id", -1) >= vocab_size}
        if outside:
            problems.append(
                f"{KEY}: step(s) {_ranges(outside)} under {root} hold token ids up to "
                f"{max(headers[s]['max_token_id'] for s in outside)}, outside the vocabulary of actor.model_path "
                f"({vocab_size} tokens); replay them on the model they were generated for"
            )
    return problems


class RolloutReplay:
    """Rank 0's source of a replay run's generation batches (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.rollout.replay_from is not None
        self.root = Path(cfg.rollout.replay_from)
        self.hashes = config_hashes(cfg)
        self._noted = False

    def _note_differences(self, header: dict[str, Any]) -> None:
        """Once per run: the configuration sections in which this run differs from the dumping one."""
        if self._noted:
            return
        self._noted = True
        theirs = header.get("config_hash", {})
        differ = sorted(k for k in set(theirs) | set(self.hashes) if theirs.get(k) != self.hashes.get(k))
        if differ:
            stderr_line(
                f"core-rl: note: {KEY}: this run's configuration differs from the dumping run's in "
                f"{', '.join(differ)}; the saved samples and rewards are trained as this configuration says"
            )

    def generations(self, step: int) -> Callable[[], Generation]:
        """Step ``step``'s saved generation batches, one per call, in the order they were drawn."""
        path = step_file(self.root, step)
        t0 = time.perf_counter()
        try:
            header, saved = read_step(path)
        except FileNotFoundError:
            raise CoreRLError(
                f"{KEY}: {path} is gone (it was there when the run started); restore it, or lower "
                f"trainer.total_steps below {step}"
            ) from None
        self._note_differences(header)
        for gen in saved:
            gen.metrics = {k: v for k, v in gen.metrics.items() if not k.startswith(CLOCK_PREFIXES)}
        if saved:
            saved[0].metrics["timing/replay_read_s"] = time.perf_counter() - t0
        pending = iter(saved)

        def next_generation() -> Generation:
            gen = next(pending, None)
            if gen is None:
                raise CoreRLError(
                    f"{KEY}: {path} holds {len(saved)} generation batch(es) and step {step} asks for another: "
                    "this run's algorithm.filters keep fewer samples than the dumping run's; replay with the "
                    "dumping run's algorithm.filters and algorithm.max_num_gen_batches"
                )
            return gen

        return next_generation
