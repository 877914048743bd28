"""Prompt data: rows from JSON/JSONL/Parquet files (loaded with ``datasets``), tokenised, drawn in
shuffled epochs with a resumable position."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.schema import DataConfig
from core_rl.errors import DataError

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@attrs.define
class PromptItem:
    """One prompt: its data row (every column), its text and its token ids."""

    row: Mapping[str, Any]
    text: str
    prompt_ids: list[int]


def load_rows(files: list[str]) -> list[tuple[str, int, dict[str, Any]]]:
    """Read every row of ``files`` in order as (file, row index in that file, row). Raises
    :class:`DataError` for a missing file or an unsupported extension."""
    from datasets import load_dataset

    rows: list[tuple[str, int, dict[str, Any]]] = []
    for name in files:
        path = Path(name)
        fmt = _FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"data.train_files: {name!r} has an unsupported extension; use .json, .jsonl or .parquet")
        if not path.is_file():
            raise DataError(f"data.train_files: {name!r} does not exist")
        table = load_dataset(fmt, data_files=str(path), split="train").to_list()
        # files with differing columns are read into one schema: drop the filled-in Nones
        rows.extend((name, i, {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(table))
    return rows


class PromptSource:
    """Draws ``batch_size`` prompts per call, reshuffling (seeded by ``seed + epoch``) at each epoch.

    ``state_dict()`` / ``load_state_dict()`` capture the position so a resumed run sees the same
    prompts it would have seen without interruption.
    """

    def __init__(self, config: DataConfig, tokenizer: Any, *, seed: int) -> None:
        self.config = config
        self.seed = seed
        rows = load_rows(config.train_files)
        if not rows:
            raise DataError(f"data.train_files: {config.train_files} hold no rows")
        self.items = [self._tokenise(f"{name}:{i}", row, tokenizer) for name, i, row in rows]
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _tokenise(self, where: str, row: Mapping[str, Any], tokenizer: Any) -> PromptItem:
        """Tokenise one row; ``where`` is ``file:row`` for error messages."""
        key = self.config.prompt_key
        if key not in row or not isinstance(row[key], str):
            raise DataError(
                f"data row {where}: no text column {key!r} (columns: {', '.join(row)}); set data.prompt_key"
            )
        text = row[key]
        if self.config.apply_chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        else:
            ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        if not ids:
            raise DataError(f"data row {where}: prompt {text!r} tokenises to nothing")
        if len(ids) > self.config.max_prompt_tokens:
            raise DataError(
                f"data row {where}: prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                f"{self.config.max_prompt_tokens}"
            )
        return PromptItem(row=row, text=text, prompt_ids=ids)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.config.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        """The next ``data.batch_size`` prompts; an epoch boundary continues into the next epoch."""
        out: list[PromptItem] = []
        while len(out) < self.config.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
