"""Stopping at ``sampling.stop`` strings during decoding (the rollout controller cuts every
engine's responses there anyway, :mod:`core_rl.rollout.stop_strings`; stopping here saves the tokens after).

At each of the host's checks (every ``sync_every`` tokens, :func:`core_rl_hf.generation.generate_batch`)
the running rows' last tokens are read back and decoded: a row whose tail holds a stop string is cut
exactly where :func:`core_rl.rollout.stop_strings.stop_cut` says, from its whole response, and finished there
(``"stop"``); :meth:`StopStringCheck.cut` makes the same cut on each finished response (a row
that ended on EOS or the budget between two checks). The tail covers the tokens since the last
check plus enough earlier ones to hold the longest stop string (every token but a special one adds
at least one character), so only rows that may hold a stop string are decoded whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
from core_rl.rollout import stop_change, stop_cut

from core_rl_hf.decode_state import DecodeState

if TYPE_CHECKING:
    from core_rl_hf.generation import Completion


class StopStringCheck:
    """``check(state, t)``: finish the rows of ``state`` whose first ``t`` tokens complete a stop string."""

    def __init__(self, stops: Sequence[str], decode: Callable[[Sequence[int]], str], min_tokens: int, every: int):
        self.stops, self.decode, self.min_tokens = list(stops), decode, min_tokens
        self.tail = every + 2 * max(len(s) for s in self.stops) + 8

    def __call__(self, state: DecodeState, t: int) -> None:
        running = (~state.done).nonzero().squeeze(-1).tolist()
        if not running or t < self.min_tokens:
            return
        tails = state.tokens[running, max(0, t - self.tail) : t].tolist()
        finished, lengths = [], []
        for row, tail in zip(running, tails):
            text = self.decode(tail)
            if not any(stop in text for stop in self.stops):
                continue
            keep = stop_cut(state.tokens[row, :t].tolist(), self.decode, self.stops, min_tokens=self.min_tokens)
            if keep is not None:
                finished.append(row)
                lengths.append(keep)
        if finished:
            state.finish(finished, lengths)

    def cut(self, completion: Completion) -> Completion:
        """``completion`` cut at its first stop string (unchanged where there is none)."""
        ids, reason = completion.token_ids, completion.finish_reason
        keep = stop_change(ids, reason, self.decode, self.stops, min_tokens=self.min_tokens)
        if keep is None:
            return completion
        return attrs.evolve(
            completion,
            token_ids=completion.token_ids[:keep],
            logprobs=completion.logprobs[:keep],
            finish_reason="stop",
        )
