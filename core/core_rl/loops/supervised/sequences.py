"""The sequences a supervised loop builds from a data row (no torch import): each a prompt, then a
response, then tokens the loop appends after it (:class:`TrainSequence`). A loop's config class
says which sequences a row makes (``row_sequences``, :class:`BuildsSequences`), so the bound on
their length (``data.max_length``, :mod:`core_rl.loops.supervised.length_bound`) is checked before the model
loads by the same code the loop builds its batches with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from core_rl.errors import DataError

if TYPE_CHECKING:
    from core_rl.config.data_config import DataConfig
    from core_rl.data.prompts import PromptItem


@attrs.frozen
class TrainSequence:
    """One sequence of a row: ``prompt`` ids, then ``response`` ids (with any EOS the loop appends),
    then ``suffix`` tokens the loop adds after the response (the ``rm`` loop's score slot).
    ``trained``: which tokens of ``prompt + response`` the loss reads, where the loop says so
    token by token (a conversation's assistant turns); ``None``: the response's. ``media``: the
    pixel inputs of the prompt's images (:attr:`core_rl.data.prompts.PromptItem.media`), or ``None``."""

    prompt: list[int]
    response: list[int]
    suffix: int = 0
    trained: list[bool] | None = None
    media: dict[str, Any] | None = None

    @property
    def length(self) -> int:
        """The tokens the model reads: ``len(prompt) + len(response) + suffix``."""
        return len(self.prompt) + len(self.response) + self.suffix


def fit_to_length(sequence: TrainSequence, max_length: int | None) -> TrainSequence:
    """``sequence`` cut at the end to at most ``max_length`` tokens (``None``: as it is): its
    response keeps its first ``max_length - len(prompt) - suffix`` tokens (a cut response loses its
    EOS with its tail), ``trained`` the same positions. The prompt is never cut (the caller checks
    that it leaves room: :func:`core_rl.loops.supervised.length_bound.bound_items`)."""
    if max_length is None or sequence.length <= max_length:
        return sequence
    keep = max(max_length - sequence.suffix - len(sequence.prompt), 0)
    response = sequence.response[:keep]
    trained = sequence.trained
    if trained is not None:
        trained = trained[: len(sequence.prompt) + len(response)]
    return attrs.evolve(sequence, response=response, trained=trained)


def token_ids(value: Any, tokenizer: Any, *, where: str) -> list[int]:
    """A response given as text (encoded without special tokens) or as a list of token ids."""
    if isinstance(value, str):
        return list(tokenizer(value, add_special_tokens=False)["input_ids"])
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise DataError([f"{where}: expected text or a list of token ids, got {type(value).__name__}"])


def response_tokens(item: PromptItem, key: str, tokenizer: Any, *, eos: bool = True) -> list[int]:
    """Token ids of the response in column ``key`` of ``item``'s row (text or ids); with ``eos``,
    ending with the tokenizer's EOS token when it has one and the ids do not already."""
    return with_eos(token_ids(item.row.get(key), tokenizer, where=column_where(item, key)), tokenizer, eos=eos)


def column_where(item: PromptItem, key: str) -> str:
    """How a problem names column ``key`` of ``item``'s row: its file and line where it has them."""
    return f"{item.where or f'data row {item.text[:40]!r}'}: column {key!r}"


def with_eos(ids: list[int], tokenizer: Any, *, eos: bool = True) -> list[int]:
    """``ids``, with ``eos`` ending with the tokenizer's EOS token when it has one and they do not already."""
    end = tokenizer.eos_token_id
    if eos and end is not None and (not ids or ids[-1] != end):
        ids.append(end)
    return ids


def pair_sequences(
    item: PromptItem, tokenizer: Any, keys: Sequence[str], *, eos: bool = True, suffix: int = 0
) -> list[TrainSequence]:
    """The sequences of a preference row: its prompt with each response of the columns ``keys``
    (chosen, then rejected; :func:`response_tokens`), each followed by ``suffix`` tokens."""
    return [
        TrainSequence(item.prompt_ids, response_tokens(item, key, tokenizer, eos=eos), suffix, media=item.media)
        for key in keys
    ]


@runtime_checkable
class BuildsSequences(Protocol):
    """A supervised loop's config class that says which sequences it trains on for a row (the
    prompt item with its tokenised prompt), with the run's tokenizer and ``data`` section; a
    :class:`~core_rl.errors.DataError` naming the row when the row cannot make them."""

    def row_sequences(self, item: PromptItem, tokenizer: Any, data: DataConfig) -> list[TrainSequence]: ...
