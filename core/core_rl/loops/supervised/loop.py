"""The base of the supervised training loops (SFT, DPO, reward-model training, ...).

A supervised loop has no rollout engine and no reward: each step draws the next ``data.batch_size``
rows (:class:`~core_rl.data.prompts.PromptSource`: seeded reshuffle per epoch, exact position in
checkpoints), turns them into a global :class:`~core_rl.protocol.TensorBatch` and takes optimiser
steps on the actor's train engine. Everything else is the run scaffold's, shared with the RL loop
(:class:`~core_rl.loops.scaffold.RunScaffold`, which this class extends): seeding, loggers
(``jsonl`` always), checkpoints on ``saver``'s schedule written atomically and pruned, resume from
the newest valid checkpoint with ``recover.mode``, SIGINT/SIGTERM ending the run after the step with
a checkpoint, disk-full handling, non-finite steps (:class:`~core_rl.loops.numerics.NonFiniteGuard`),
a reference reset where a loop builds a reference (``algorithm.reference_reset_every_n_steps``), and
the final Hugging Face export; in-process restarts are :mod:`core_rl.loops.run`'s.

Under ``torchrun`` every rank reads the same rows in the same order (the same seed), so no batch is
broadcast; each rank trains on the rows :meth:`SupervisedLoop.shard_rows` gives it.

A subclass implements :meth:`SupervisedLoop.make_batch` and :meth:`SupervisedLoop.train_batch`, and
may build more models in :meth:`SupervisedLoop.build_models`.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

import torch

from core_rl.config.schema import RunConfig
from core_rl.data.prompts import DataRow, PromptItem, PromptSource
from core_rl.interfaces import LossFn, ValueLossFn
from core_rl.launch.ranks import agree_after, rank_and_world, set_collective_timeout, waiting_for
from core_rl.loops.building import build_loggers
from core_rl.loops.scaffold import RunScaffold
from core_rl.loops.signals import StopSignals
from core_rl.loops.supervised.batches import prompt_response_batch as prompt_response_batch  # loops import them here
from core_rl.loops.supervised.batches import sequence_batch as sequence_batch
from core_rl.loops.supervised.length_bound import run_bound
from core_rl.loops.supervised.sequences import TrainSequence, column_where, fit_to_length, with_eos
from core_rl.loops.supervised.sequences import token_ids as token_ids  # where the loops have imported it from
from core_rl.plugins.guards import engine_metrics
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import TRAIN_ENGINE
from core_rl.plugins.registry import RegistryEntry
from core_rl.protocol import TensorBatch
from core_rl.roles.build import build_engine


def global_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the data-parallel ranks (itself in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


class SupervisedLoop(RunScaffold):
    """A loop over data rows with the actor's train engine; see the module docstring.

    ``config``: the loop's own validated ``trainer.loop`` section (:attr:`loop_config`).
    :attr:`actor_head`: the head the actor's engine is built with (:data:`core_rl.interfaces.HEADS`;
    ``score`` for a reward model)."""

    actor_head: str = "lm"

    def __init__(
        self,
        cfg: RunConfig,
        host: PluginHost,
        *,
        stop: StopSignals | None = None,
        data_rows: list[DataRow] | None = None,
        config: Any = None,
    ) -> None:
        self.loop_config = config
        super().__init__(cfg, host, stop=stop, data_rows=data_rows)

    # -- building -----------------------------------------------------------------------------

    def _build(self) -> None:
        cfg, host = self.cfg, self.host
        set_collective_timeout(cfg.trainer.collective_timeout_s)
        engine_entry = host.get(TRAIN_ENGINE, cfg.actor.engine.name)
        self.engine = build_engine(host, cfg.actor, trainable=True, head=self.actor_head, built=self.built_engines)
        self.build_models(engine_entry)
        set_collective_timeout(cfg.trainer.collective_timeout_s)
        self.rank, self.world_size = rank_and_world()
        self._load_tokenizer()
        self.data = PromptSource(
            cfg.data,
            self.tokenizer,
            seed=cfg.experiment.seed,
            rows=self._data_rows,
            select=run_bound(cfg, self.tokenizer),
        )
        error: Exception | None = None
        if self.is_main:
            try:
                self.loggers = build_loggers(cfg, host)
            except Exception as exc:
                error = exc
        agree_after("building the loggers (rank 0)", error)

    def build_models(self, engine_entry: RegistryEntry) -> None:
        """Build models besides the actor (e.g. a frozen reference with ``trainable=False``).
        Default: none."""

    def response_ids(self, value: Any, item: PromptItem, key: str) -> list[int]:
        """Token ids of the response in column ``key`` of ``item``'s row (text or ids), ending
        with the tokenizer's EOS token when it has one and the ids do not already."""
        return with_eos(token_ids(value, self.tokenizer, where=column_where(item, key)), self.tokenizer)

    def sequences(self, item: PromptItem) -> list[TrainSequence]:
        """The sequences of ``item``'s row as the loop's config says (``row_sequences``,
        :mod:`core_rl.loops.supervised.sequences`), each cut to ``data.max_length`` with ``data.truncation:
        truncate`` (:func:`~core_rl.loops.supervised.sequences.fit_to_length`; rows that cannot be cut, or are too long
        under ``error`` or ``drop``, never reach here: :mod:`core_rl.loops.supervised.length_bound`)."""
        rows = self.loop_config.row_sequences(item, self.tokenizer, self.cfg.data)
        return [fit_to_length(s, self.cfg.data.max_length) for s in rows]

    # -- one step -----------------------------------------------------------------------------

    @abstractmethod
    def make_batch(self, items: list[PromptItem]) -> TensorBatch:
        """The global batch of a step from its ``data.batch_size`` rows (identical on every rank)."""

    @abstractmethod
    def train_batch(self, batch: TensorBatch, step: int) -> dict[str, float]:
        """Train on ``batch`` (usually one :meth:`optimizer_step`); return the step's metrics."""

    def shard_rows(self, batch: TensorBatch) -> TensorBatch:
        """This rank's rows of the global ``batch`` (default: token-balanced, as the RL loop)."""
        return self._shard(batch)

    def optimizer_step(self, shard: TensorBatch, loss_fn: LossFn | ValueLossFn, step: int) -> dict[str, float]:
        """One engine ``train_step`` on this rank's ``shard`` (``train_value_step``, with a
        :data:`~core_rl.interfaces.ValueLossFn`, when :attr:`actor_head` is a value head); the
        engine's metrics as ``actor/<name>`` plus the non-finite accounting (a non-finite step is
        skipped and its batch saved, or ends the run, as ``trainer.on_nonfinite`` says)."""
        with waiting_for(f"the other ranks in the update of step {step}"):
            method = "train_step" if self.actor_head == "lm" else "train_value_step"
            out = engine_metrics(self.engine, method, shard, loss_fn)
        metrics = {f"actor/{k}": v for k, v in out.items()}
        metrics.update(self.nonfinite.check(step, shard, out))
        return metrics

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.make_batch(self.data.next_batch())
        metrics = self.train_batch(batch, step)
        elapsed = time.perf_counter() - t0
        tokens = float(batch["attention_mask"].sum())
        metrics.update({"timing/step_s": elapsed, "throughput/tokens_per_s": tokens / max(elapsed, 1e-9)})
        return metrics
