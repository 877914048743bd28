"""``algorithm.ptx`` (:class:`core_rl.config.schema.PTXConfig`): supervised rows mixed into every
optimiser step of the policy.

:class:`PTXRows` reads and tokenises the rows once (on every rank alike, so every rank draws the
same ones) and hands out ``rows`` sequences per optimiser step in a seeded order, reshuffled each
epoch, whose position checkpoints keep. :func:`with_ptx` appends them to a minibatch: their
``response_mask`` and ``loss_mask`` are 0 (the policy loss, its metrics and its aggregation never see
them), ``ptx_mask`` marks their completion tokens and their ``loss_weight`` is
``coef / (completion tokens of the step's ptx rows)``. :class:`PTXLoss` wraps the policy loss: on
``ptx_mask`` tokens the per-token loss is ``-log pi``, elsewhere the policy loss's. So the step
minimises ``policy loss + coef * mean NLL over the ptx completion tokens``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from core_rl.config.schema import DataConfig, PTXConfig
from core_rl.data.files import read_data_files
from core_rl.data.prompts import tokenise_rows
from core_rl.errors import DataError
from core_rl.interfaces import LossOutput, PolicyLoss
from core_rl.launch.distributed import summed_over_ranks
from core_rl.loops.rl.wrapping_loss import WrappingLoss
from core_rl.loops.supervised.batches import prompt_response_batch
from core_rl.loops.supervised.sequences import TrainSequence, fit_to_length, response_tokens
from core_rl.protocol import TensorBatch, concat_padded

KEY = "algorithm.ptx.files"


class PTXRows:
    """The ptx rows of a run and where their draw stands (module docstring)."""

    def __init__(self, config: PTXConfig, data: DataConfig, tokenizer: Any, *, seed: int) -> None:
        self.config, self.seed = config, seed
        rows, problems = read_data_files(config.files, key=KEY, sources=data.sources)
        prompts = attrs.evolve(data, prompt_key=config.prompt_key, max_prompt_tokens=config.max_length)
        items, more = tokenise_rows(rows, prompts, tokenizer, files_key=KEY) if not problems else ([], [])
        problems += more
        self.sequences: list[TrainSequence] = []
        for item in items:
            try:
                response = response_tokens(item, config.response_key, tokenizer)
            except DataError as exc:
                problems += exc.problems
                continue
            self.sequences.append(fit_to_length(TrainSequence(item.prompt_ids, response), config.max_length))
        if not problems and not self.sequences:
            problems.append(f"{KEY}: {config.files} hold no rows")
        if problems:
            raise DataError(problems)
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.sequences)))
        random.Random(f"core-rl-ptx:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_rows(self) -> list[TrainSequence]:
        """The next ``rows`` sequences; an epoch's end continues into the next, reshuffled."""
        out = []
        while len(out) < self.config.rows:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.sequences[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            self._order = self._permutation(self.epoch)


def with_ptx(minibatch: TensorBatch, sequences: list[TrainSequence], coef: float, pad_token_id: int) -> TensorBatch:
    """``minibatch`` (with its ``loss_weight``) followed by the rows of ``sequences`` (module
    docstring); every key of the minibatch they lack is 0 on them, ``ptx_mask`` 0 on its rows."""
    ptx = prompt_response_batch([s.prompt for s in sequences], [s.response for s in sequences], pad_token_id)
    target = ptx["response_mask"]
    width, rows = minibatch["input_ids"].shape[1], len(sequences)
    extra: dict[str, torch.Tensor] = {}
    for key in minibatch.keys():
        value = minibatch[key]
        if key in ("input_ids", "attention_mask"):
            extra[key] = ptx[key]
        elif value.ndim >= 2 and value.shape[1] == width:
            extra[key] = value.new_zeros((rows, target.shape[1], *value.shape[2:]))
        else:
            extra[key] = value.new_zeros((rows, *value.shape[1:]))
    extra["loss_weight"] = (target * (coef / target.sum().clamp(min=1.0))).to(minibatch["loss_weight"].dtype)
    extra["ptx_mask"] = target
    base = TensorBatch({key: minibatch[key] for key in minibatch.keys()})
    base["ptx_mask"] = torch.zeros_like(minibatch["response_mask"], dtype=torch.float32)
    return concat_padded([base, TensorBatch(extra)], pad_token_id)


class PTXLoss(WrappingLoss):
    """The policy loss ``base`` on its rows, ``-log pi`` on the ``ptx_mask`` tokens (module
    docstring); aggregation, preparation, rejection sampling and state are the base's. Keeps the
    mean NLL of the ptx tokens every rank saw since the last optimiser step (``ptx_nll``: this rank's
    sums, added up over the ranks in :meth:`observe_step`, which every rank calls)."""

    def __init__(self, base: PolicyLoss) -> None:
        super().__init__(base)
        self._nll, self._tokens = 0.0, 0.0

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        out = dict(self.base.observe_step(metrics))
        nll, tokens = summed_over_ranks([self._nll, self._tokens])
        if tokens:
            out["ptx_nll"] = nll / tokens
        self._nll, self._tokens = 0.0, 0.0
        return out

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        out = self.base(batch, logprobs, entropy)
        if "ptx_mask" not in batch:
            return out
        ptx = batch["ptx_mask"].to(logprobs.dtype)
        self._nll += float((-logprobs.detach() * ptx).sum())
        self._tokens += float(ptx.sum())
        per_token = torch.where(ptx > 0, -logprobs, out.per_token_loss)
        return LossOutput(per_token_loss=per_token, token_metrics=out.token_metrics)
