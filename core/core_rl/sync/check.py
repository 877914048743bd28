"""The verified weight sync (``rollout.sync_check``): after a sync, the rollout engine must hold the
weights the trainer sent, or the run stops at that step.

The trainer's side samples every tensor it sends (:class:`SentWeights`: :func:`core_rl.sync.fingerprint.sample`,
a handful of strided elements per tensor, at positions drawn from the tensor's name and the weight
version): the buckets of ``memory`` as they pass, the state dict of ``collective``, the files of
``disk`` (the directory it exported, or the adapter with ``rollout.lora_sync: adapter``) before the
engine reads them. The rollout engine fingerprints what it loaded
(:meth:`~core_rl.interfaces.RolloutEngine.weight_fingerprints`, by replica); the trainer folds its
samples in the dtype each weight reached the engine in
(:meth:`~core_rl.interfaces.RolloutEngine.fingerprint_dtypes`: a bfloat16 vLLM server's collective
carries bfloat16) and compares, tensor by tensor in the order sent. Tied weights are sent once, and
fingerprinted once. A difference raises :class:`WeightSyncMismatch` (exit status 1) naming the
engine, the replica, the mode, the first tensor that differs and the version.

``every_n_syncs`` thins it: the N-th, 2N-th, ... sync of this process is checked (every rank counts
the same syncs, so they agree on which ones).

A rollout engine that refuses a sync outright, because the weights do not fit its model (the
embedded ``hf`` engine raises :class:`KeyError` for a tensor missing or unexpected and
:class:`ValueError` for one misshapen), stops the run the same way, checked or not
(:meth:`SyncCheck.refusals`): one line naming the engine, the mode, the version and the tensors.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from core_rl.config.schema import RunConfig
from core_rl.errors import stderr_line
from core_rl.interfaces import RolloutEngine
from core_rl.loops.errors import RunFailed
from core_rl.sync.fingerprint import file_samples, first_difference, fold_all, sample_all


class WeightSyncMismatch(RunFailed):
    """The rollout engine does not hold the weights the trainer sent in a sync."""


class SentWeights:
    """The trainer's samples of the tensors of one sync (version :attr:`version`), by name in the
    order sent, and the seconds spent taking them (:attr:`seconds`). ``prefix``: draw each tensor's
    samples from its first rows only (:func:`core_rl.sync.fingerprint.prefix_numel`; the rollout
    engine's :attr:`~core_rl.interfaces.RolloutEngine.fingerprint_prefix`)."""

    def __init__(self, version: int, prefix: int | None = None) -> None:
        self.version = version
        self.prefix = prefix
        self.samples: dict[str, torch.Tensor] = {}
        self.seconds = 0.0

    def add_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Sample every tensor of ``state`` (together: :func:`core_rl.sync.fingerprint.sample_all`)."""
        start = time.perf_counter()
        self.samples.update(sample_all(state.items(), self.version, self.prefix))
        self.seconds += time.perf_counter() - start

    def passing(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[Mapping[str, torch.Tensor]]:
        """``buckets`` unchanged, each tensor sampled as it passes."""
        for bucket in buckets:
            self.add_state(bucket)
            yield bucket
            del bucket  # not held while the next one is gathered

    def add_dir(self, path: Path) -> None:
        """Every tensor of the ``*.safetensors`` files the trainer wrote to ``path``."""
        start = time.perf_counter()
        self.samples.update(file_samples(path, self.version, self.prefix))
        self.seconds += time.perf_counter() - start

    def prints(self, rollout: RolloutEngine, mode: str) -> dict[str, float]:
        """The fingerprints, each in the dtype the rollout engine says it sees it in after a
        ``mode`` update (:meth:`~core_rl.interfaces.RolloutEngine.fingerprint_dtypes`)."""
        names = list(self.samples)
        dtypes = rollout.fingerprint_dtypes(names, [self.samples[n].dtype for n in names], mode)
        return dict(zip(names, fold_all([self.samples[n] for n in names], dtypes)))


class SyncCheck:
    """Which syncs are checked (``rollout.sync_check``) and the check itself (module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.config = cfg.rollout.sync_check
        self.engine_name = cfg.rollout.engine.name
        self.weight_sync = cfg.rollout.weight_sync
        self.mode = cfg.rollout.weight_sync + (
            " (rollout.lora_sync: adapter)" if cfg.rollout.lora_sync == "adapter" else ""
        )
        self.syncs = 0
        self._noted = False

    def start(self, version: int, prefix: int | None = None) -> SentWeights | None:
        """Count a sync of ``version`` (every rank calls this for every sync); the samples to take
        (within each tensor's first ``prefix`` elements' rows, where the rollout engine reads back
        only those) when this one is checked, else ``None``."""
        self.syncs += 1
        if not self.config.enabled or self.syncs % self.config.every_n_syncs:
            return None
        return SentWeights(version, prefix)

    @contextlib.contextmanager
    def refusals(self, version: int) -> Iterator[None]:
        """Around a rollout engine's weight update of ``version``: its :class:`KeyError` or
        :class:`ValueError` (weights that do not fit its model: the ``hf`` engine's message names
        the tensors missing, unexpected or misshapen) becomes :class:`WeightSyncMismatch`, one line
        naming the engine, the mode, the version and that message (the original chained). Other
        errors pass unchanged."""
        try:
            yield
        except (KeyError, ValueError) as exc:
            reason = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
            raise WeightSyncMismatch(
                f"weight sync of weight version {version} refused: rollout engine {self.engine_name!r}, "
                f"rollout.weight_sync: {self.mode}: {reason}. The trainer sent weights that do not fit the "
                "rollout model, so the run stops here"
            ) from exc

    def verify(self, rollout: RolloutEngine, sent: SentWeights) -> dict[str, float]:
        """Compare what ``rollout`` loaded with ``sent``; raise :class:`WeightSyncMismatch` on a
        difference. Returns ``timing/sync_check_s`` (the trainer's sampling, the engine's answer and
        the comparison) and ``weight_sync/checked_tensors``."""
        start = time.perf_counter()
        loaded = rollout.weight_fingerprints(sent.version)
        if loaded is None:
            if not self._noted:
                self._noted = True
                stderr_line(
                    f"core-rl: note: rollout engine {self.engine_name!r} cannot report the weights it loaded: "
                    "the weight sync check (rollout.sync_check) is skipped"
                )
            return {}
        want = sent.prints(rollout, self.weight_sync)
        for replica, prints in loaded.items():
            found = first_difference(want, prints)
            if found is not None:
                name, what = found
                if prints:
                    detail = f"the first tensor that differs is {name} ({what})"
                else:  # a replica restarted without the weights, or one the update never reached
                    detail = f"it holds no weights of this version: the first tensor that differs is {name}"
                raise WeightSyncMismatch(
                    f"weight sync check failed at weight version {sent.version}: rollout engine "
                    f"{self.engine_name!r} ({replica}), rollout.weight_sync: {self.mode}: {detail}. "
                    "The rollout engine does not hold the trainer's weights, so the run stops here "
                    "(rollout.sync_check.enabled: false turns the check off)"
                )
        return {
            "timing/sync_check_s": sent.seconds + time.perf_counter() - start,
            # an engine may leave some unread this time (NaN: weight_fingerprint.first_difference)
            "weight_sync/checked_tensors": float(
                min((sum(1 for v in p.values() if not math.isnan(v)) for p in loaded.values()), default=len(want))
            ),
        }
