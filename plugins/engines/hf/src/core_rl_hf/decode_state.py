"""The bookkeeping of a decoding batch, kept on the device: what each row has generated and
whether it has finished, updated by tensor operations only (no value is read back to the host).

For batch row ``b`` and token index ``t`` (a one-element device tensor, advanced by each
:meth:`DecodeState.choose`), :meth:`DecodeState.choose` takes the next-token logits and

- chooses ``token_b`` and its behaviour log-prob (:func:`core_rl_hf.sampling.choose_tokens`), with
  the stop ids blocked while ``t < min_new_tokens``;
- if row ``b`` is still running, records them in column ``t`` of its ``tokens`` / ``logprobs``;
- if ``token_b`` is a stop id (EOS or ``stop_token_ids``), finishes the row: ``length = t + 1``,
  ``stopped`` set, ``done`` set;
- sets ``feed_b``, the token the next step feeds: ``token_b``, or the pad id once the row is done.

With penalties (:func:`core_rl_hf.sampling.penalties_set`) it also keeps, per row, ``seen`` (bool
[rows, V]: the token is in the prompt or the response so far) and ``counts`` (float [rows, V]: the
times the token is in the response so far), which :func:`core_rl_hf.sampling.apply_penalties`
reads before each choice: :meth:`DecodeState.load_context` fills them from the prompts, each
choice adds its token (in every row: a finished row's are never read). They cost
``rows x V x 5`` bytes, and each step a few ``rows x V`` float32 temporaries, only with penalties.

Rows start with ``length = steps`` (``"length"`` if they never stop). :meth:`DecodeState.abort`
sets the length of running rows to the tokens they have. :meth:`DecodeState.keep` drops rows
(recording theirs first), :meth:`DecodeState.results` returns every sample's record in its order.

A state captured in a CUDA graph serves later batches of at most its rows and steps
(:meth:`DecodeState.reset` with ``steps`` and ``live``): the rows past ``live`` are fillers, done
from the start (they record nothing), and the batch generates ``steps`` tokens at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from core_rl.interfaces import SamplingParams

from core_rl_hf.sampling import apply_penalties, choose_tokens, penalties_set, uniform_draws


class DecodeState:
    """Per-row record of ``total`` samples of up to ``steps`` tokens over a vocabulary of ``vocab``."""

    def __init__(
        self,
        total: int,
        steps: int,
        vocab: int,
        sampling: SamplingParams,
        *,
        stop_ids: Sequence[int],
        pad_token_id: int,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.sampling, self.steps, self.pad, self.generator = sampling, steps, pad_token_id, generator
        self.stop_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.stop_mask[[i for i in stop_ids if 0 <= i < vocab]] = True
        self.tokens = torch.empty((total, steps), dtype=torch.long, device=device)
        self.logprobs = torch.empty((total, steps), dtype=torch.float32, device=device)
        self.lengths = torch.empty(total, dtype=torch.long, device=device)
        self.stopped = torch.empty(total, dtype=torch.bool, device=device)
        self.done = torch.empty(total, dtype=torch.bool, device=device)
        self.feed = torch.empty(total, dtype=torch.long, device=device)
        self.t = torch.empty(1, dtype=torch.long, device=device)
        # read by the step from the device, so a captured step serves any positive min_new_tokens
        self.blocks_stops = sampling.min_new_tokens > 0
        self.min_new_tokens = torch.full((1,), sampling.min_new_tokens, dtype=torch.long, device=device)
        self.sequence = torch.arange(total, device=device)  # the sample each batch row generates
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        if penalties_set(sampling):
            self.seen = torch.zeros((total, vocab), dtype=torch.bool, device=device)
            self.counts = torch.zeros((total, vocab), dtype=torch.float32, device=device)
        # every sample's record, filled from the rows when rows are dropped and at the end
        self._out = (self.tokens, self.logprobs, self.lengths, self.stopped)
        self.live = total  # rows of the batch; those past it are fillers (reset)
        self.reset()

    def reset(self, steps: int | None = None, live: int | None = None, min_new_tokens: int | None = None) -> None:
        """Back to no token generated (in place: a captured graph keeps reading these buffers),
        for a batch of ``live`` rows (default all; the others are done from the start) of at most
        ``steps`` tokens (default the state's ``steps``; at most that) with stop tokens blocked for
        the first ``min_new_tokens`` (default: as before; positive only if it was positive)."""
        steps = self.steps if steps is None else steps
        self.live = len(self.done) if live is None else live
        if steps > self.steps or self.live > len(self.done):
            raise ValueError(f"a state of {len(self.done)} rows x {self.steps} steps cannot hold {self.live} x {steps}")
        if min_new_tokens is not None:
            if (min_new_tokens > 0) != self.blocks_stops:
                made = self.sampling.min_new_tokens
                raise ValueError(f"min_new_tokens {min_new_tokens} for a state made with {made}")
            self.min_new_tokens.fill_(min_new_tokens)
        self.tokens.fill_(self.pad)
        self.logprobs.zero_()
        self.lengths.fill_(steps)
        self.stopped.zero_()
        self.done.zero_()
        self.done[self.live :] = True
        self.feed.fill_(self.pad)
        self.t.zero_()

    def load_context(self, tokens: torch.Tensor, real: torch.Tensor, generated: torch.Tensor) -> None:
        """Set the penalties' ``seen`` and ``counts`` (in place) from each row's context: ``tokens``
        [rows, L] where ``real`` (bool [rows, L]) marks its tokens (not padding), ``generated``
        (bool [rows, L]) those that are a response so far (a continued sample's earlier tokens:
        counted by the frequency and presence penalties). Nothing without penalties."""
        if self.seen is None or self.counts is None:
            return
        self.counts.zero_().scatter_add_(1, tokens, real.float())
        self.seen.copy_(self.counts > 0)
        self.counts.zero_().scatter_add_(1, tokens, (real & generated).float())

    def draw(self) -> torch.Tensor | None:
        """The uniform numbers the next sampled choice takes, one per row (``[rows, 1]`` float64,
        from the state's generator: :func:`~core_rl_hf.sampling.uniform_draws`); ``None`` when the
        choice is greedy."""
        if self.sampling.greedy:
            return None
        return uniform_draws(len(self.done), self.done.device, self.generator)

    def choose(self, logits: torch.Tensor, uniform: torch.Tensor | None = None) -> None:
        """Choose and record token ``t`` of every row from ``logits`` [rows, V] (module docstring);
        a sampled choice with the draws ``uniform`` (:meth:`draw`) where given, else drawing them."""
        blocked = None
        if self.blocks_stops:
            blocked = self.stop_mask & (self.t < self.min_new_tokens)
        penalised = None
        if self.seen is not None and self.counts is not None:
            penalised = apply_penalties(logits, self.seen, self.counts, self.sampling)
        token, logprob = choose_tokens(
            logits, self.sampling, blocked=blocked, generator=self.generator, penalised=penalised, uniform=uniform
        )
        if self.seen is not None and self.counts is not None:
            self.seen.scatter_(1, token[:, None], True)
            self.counts.scatter_add_(1, token[:, None], torch.ones_like(logprob)[:, None])
        running = ~self.done
        column = self.t.expand(len(token))[:, None]
        self.tokens.scatter_(1, column, torch.where(running, token, self.pad)[:, None])
        self.logprobs.scatter_(1, column, torch.where(running, logprob, 0.0)[:, None])
        new_stop = running & self.stop_mask[token]
        self.lengths.copy_(torch.where(new_stop, self.t + 1, self.lengths))
        self.stopped.logical_or_(new_stop)
        self.done.logical_or_(new_stop)
        self.feed.copy_(torch.where(self.done, self.pad, token))
        self.t.add_(1)

    def finish(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Finish batch ``rows`` as stopped after ``lengths`` tokens (a stop string the host found,
        :mod:`core_rl_hf.stop_check`); in place, as a captured graph reads these buffers."""
        index = torch.as_tensor(list(rows), device=self.done.device)
        self.lengths[index] = torch.as_tensor(list(lengths), device=self.done.device)
        self.stopped[index] = True
        self.done[index] = True

    def abort(self) -> None:
        """End the running rows here: their length is the tokens they have."""
        self.lengths.copy_(torch.where(self.done, self.lengths, self.t))

    def finished(self) -> int:
        """How many rows are done (reads one number back: a host synchronisation)."""
        return int(self.done.sum())

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (their order), recording every row's state first."""
        self._record()
        self.tokens, self.logprobs = self.tokens[rows], self.logprobs[rows]
        self.lengths, self.stopped, self.done = self.lengths[rows], self.stopped[rows], self.done[rows]
        self.feed, self.sequence = self.feed[rows], self.sequence[rows]
        if self.seen is not None and self.counts is not None:
            self.seen, self.counts = self.seen[rows], self.counts[rows]

    def _record(self) -> None:
        for out, rows in zip(self._out, (self.tokens, self.logprobs, self.lengths, self.stopped)):
            if out is not rows:
                out.index_copy_(0, self.sequence, rows)

    def results(self) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]]:
        """Per sample of the ``live`` rows (in order): its tokens and log-probs (``steps`` columns
        each, to be cut at its length), its length and whether it stopped on a stop token."""
        self._record()
        tokens, logprobs, lengths, stopped = (out[: self.live] for out in self._out)
        return tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
