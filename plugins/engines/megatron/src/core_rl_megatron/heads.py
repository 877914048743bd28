"""The scalar head of a value model (``head="value"``: a critic) or a reward model (``"score"``)
on a Megatron-core ``GPTModel``: it takes the place of the output layer on the last pipeline stage.

The head is Hugging Face's ``*ForTokenClassification`` head with one label: ``v = h @ w.T (+ b)``
for each position's final hidden state ``h`` (after the final norm), ``w`` of shape ``[1, hidden]``
and a bias ``b`` of shape ``[1]`` for ``value`` only (``score`` has none, as Hugging Face's
``*ForSequenceClassification`` head, the format a reward model is served in).

Tensor parallelism: the hidden state entering the output layer is complete on every
tensor-parallel rank, so the head is *replicated*: every rank computes the same values, and with
the same loss on every rank each rank's gradients are already complete (the head's, and the hidden
state's, which the decoder's row-parallel layers expect to be replicated). Under sequence
parallelism each rank holds a slice of the sequence: the head runs on the slice, the values are
all-gathered along the sequence (backward keeps the rank's slice of the complete gradient), and the
head's parameters are marked ``sequence_parallel`` so Megatron's ``finalize_model_grads`` sums
their partial gradients over the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: the heads that replace the output layer (see :data:`core_rl.interfaces.VALUE_HEADS`)
SCALAR_HEADS = ("value", "score")


class ScalarHead(nn.Module):
    """``[s, b, hidden] -> ([s, b, 1], None)``, called as ``GPTModel`` calls its output layer
    (``weight`` and ``runtime_gather_output`` are accepted and ignored: nothing is shared with the
    embedding, and the output is never vocabulary-parallel). Starts at zero; the engine loads it."""

    def __init__(
        self, hidden_size: int, *, bias: bool, sequence_parallel: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        #: read by ``GPTModel`` (inference with sequence parallelism) as for its own output layer
        self.sequence_parallel = sequence_parallel
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        out = F.linear(hidden, self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # the loss on the gathered values is the same on every rank: its gradient is complete
            # everywhere, so backward keeps this rank's slice rather than summing over ranks
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


def install_scalar_head(gpt: nn.Module, head: str, *, sequence_parallel: bool) -> None:
    """Replace ``gpt.output_layer`` (a last-stage ``GPTModel``'s vocabulary projection) with a
    :class:`ScalarHead` of the same dtype and device; a chunk without an output layer (not the last
    pipeline stage) is left alone."""
    if head not in SCALAR_HEADS:
        raise ValueError(f"head must be one of {SCALAR_HEADS}, got {head!r}")
    if not getattr(gpt, "post_process", False):
        return
    old = gpt.output_layer.weight  # [vocabulary rows of this rank, hidden]: only its dtype and device are kept
    gpt.output_layer = ScalarHead(
        gpt.config.hidden_size,
        bias=head == "value",
        sequence_parallel=sequence_parallel,
        dtype=old.dtype,
        device=old.device,
    )
