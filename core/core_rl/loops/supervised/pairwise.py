"""What the pairwise preference loops share (``dpo``, ``rm``): rows holding a prompt and two
responses, the chosen and the rejected one (each text or token ids), in the columns
``loop_config.chosen_key`` / ``loop_config.rejected_key``.

Layout of a step's global batch of ``P`` pairs: the ``P`` chosen rows, then the ``P`` rejected rows
in the same order, so pair ``i`` is rows ``i`` and ``P + i``. Under ``torchrun`` rank ``r`` trains
pairs ``r, r + W, ...`` (both rows of a pair on one rank), keeping the same layout in its shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from core_rl.data.prompts import PromptItem, check_rows, read_data_files, tokenise_rows
from core_rl.errors import DataError
from core_rl.loops.supervised.length_bound import run_bound
from core_rl.loops.supervised.loop import SupervisedLoop
from core_rl.loops.supervised.sequences import TrainSequence
from core_rl.protocol import TensorBatch


def number_in_row(item: PromptItem, key: str, *, setting: str, remedy: str) -> float:
    """The number in column ``key`` of ``item``'s row (a per-pair value such as a precomputed
    reference log-prob or a margin); a :class:`~core_rl.errors.DataError` naming the ``setting`` that
    reads it, the row, the column and the ``remedy`` when it holds none."""
    value = item.row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(
            [
                f"{setting} but the row of prompt {item.text[:40]!r} has no number in column {key!r} "
                f"(got {value!r}); {remedy}"
            ]
        )
    return float(value)


class PairwiseLoop(SupervisedLoop):
    """A :class:`~core_rl.loops.supervised.loop.SupervisedLoop` over preference pairs (see the module
    docstring); its config's ``row_sequences`` gives each row's chosen and rejected sequences
    (:func:`core_rl.loops.supervised.sequences.pair_sequences`)."""

    def pair_sequences(self, items: Sequence[PromptItem]) -> list[TrainSequence]:
        """The chosen sequences of ``items``, then their rejected ones in the same order (each row's
        :meth:`~core_rl.loops.supervised.loop.SupervisedLoop.sequences`, cut to ``data.max_length`` with
        ``data.truncation: truncate``): the rows of a step's batch."""
        pairs = [self.sequences(item) for item in items]
        return [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]

    def shard_rows(self, batch: TensorBatch) -> TensorBatch:
        """Pairs ``rank, rank + W, ...``: their chosen rows, then their rejected rows."""
        pairs = batch.batch_size // 2
        mine = list(range(self.rank, pairs, self.world_size))
        return batch.rows(mine + [pairs + i for i in mine])

    def read_pairs(self, files: Sequence[str], *, key: str) -> list[PromptItem]:
        """Every row of ``files`` (held-out pairs), in file order, with its prompt tokenised as the
        training data's (``data.prompt_key``, ``data.apply_chat_template``); a
        :class:`~core_rl.errors.DataError` naming the config key ``key`` on a problem. ``data.max_length``
        bounds them as the training rows (:mod:`core_rl.loops.supervised.length_bound`)."""
        rows, problems = read_data_files(files, sources=self.cfg.data.sources)
        problems = problems or check_rows(
            rows, self.cfg.data.prompt_key, {}, chat_template=self.cfg.data.apply_chat_template
        )
        items: list[PromptItem] = []
        if not problems:
            items, problems = tokenise_rows(rows, self.cfg.data, self.tokenizer, files_key=key)
        select = run_bound(self.cfg, self.tokenizer, files_key=key)
        if not problems and select is not None:
            items, problems = select(items)
        if not problems and not items:
            problems = [f"{list(files)} hold no rows"]
        if problems:
            raise DataError([f"{key}: {p}" for p in problems])
        return items
