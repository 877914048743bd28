"""Batches of prompt + response rows for the supervised loops and the ptx rows of the rl loop
(re-exported by :mod:`core_rl.loops.supervised.loop`, where the loops import them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core_rl.loops.supervised.sequences import TrainSequence
from core_rl.protocol import TensorBatch
from core_rl.vision.media import pad_media


def prompt_response_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int
) -> TensorBatch:
    """Right-padded ``input_ids`` / ``attention_mask`` [B, T] of ``prompt + response`` rows, with
    ``response_mask`` 1.0 on the response tokens (the positions whose log-prob the loss reads)."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    n, width = len(lengths), max(lengths)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) : len(p) + len(r)] = 1.0
    return TensorBatch({"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask})


def sequence_batch(sequences: Sequence[TrainSequence], pad_token_id: int) -> TensorBatch:
    """:func:`prompt_response_batch` of ``sequences`` (their ``suffix`` tokens are the caller's to
    add), ``response_mask`` set to ``trained`` on the rows that say which tokens train, and the
    rows' pixel inputs when some have images (:func:`core_rl.vision.media.pad_media`)."""
    batch = prompt_response_batch([s.prompt for s in sequences], [s.response for s in sequences], pad_token_id)
    for row, s in enumerate(sequences):
        if s.trained is not None:
            batch["response_mask"][row, : len(s.trained)] = torch.tensor(s.trained, dtype=torch.float32)
    for key, value in pad_media([getattr(s, "media", None) for s in sequences]).items():
        batch[key] = value  # a vision-language model's pixel inputs, row by row
    return batch
