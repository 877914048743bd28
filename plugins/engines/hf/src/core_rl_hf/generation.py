"""Batched autoregressive sampling with a KV cache over left-padded prompts.

Prompts of different lengths are right-aligned (left padding) so every row's next token sits in the
last column. Position ids count real tokens only (``position = cumsum(mask) - 1``), so a padded row
sees exactly the positions, and hence the logits, it would see alone; padded columns are masked out
of attention.

Each distinct prompt is run through the model once (the prefill: by the lean stepper when it
decodes eagerly, :meth:`core_rl_hf.decode.LeanStepper.prefill`, else by the model's forward); its
KV cache, attention mask and next-token logits are then repeated for the ``count`` samples drawn
from it. Each later step feeds one new token per row with the cache of the previous steps.

A row finishes when it produces a stop token (EOS or one of ``stop_token_ids``); stop tokens are
blocked while fewer than ``min_new_tokens`` tokens exist. Its response is the tokens up to and
including that token (``"stop"``). Rows still running after ``max_new_tokens`` tokens end with
``"length"``. A row still running when ``interrupted()`` turns true (checked before each token
after the first) ends with ``"abort"`` and the tokens it has; the caller continues it later.

The per-row bookkeeping (choosing, recording, stop detection, ``min_new_tokens`` blocking) stays
on the device (:mod:`core_rl_hf.decode_state`): per token nothing is read back to the host. Every
``sync_every`` tokens the host reads how many rows are done, stops when all are, and drops the
finished rows from the batch (and the cache) once they make up a quarter of it; until then they are
fed a filler token whose outputs are discarded. A response is cut at its length at the end, so the
results do not depend on ``sync_every`` (greedy ones bit for bit; sampled ones draw the same
distribution, but rows kept longer draw their noise from the generator too). The KV cache is
preallocated for the prompt plus ``max_new_tokens`` positions. Each decoding step runs through a
stepper (:mod:`core_rl_hf.decode`): the lean path for Llama and Qwen2 models, the model's own
forward otherwise; with ``graphs`` a lean step and the choice after it are replayed from a CUDA
graph (:mod:`core_rl_hf.graphs`; the batch keeps its rows then, padded to the graph's rows with
copies of the first row that are done from the start).

With ``record_routes`` (a mixture-of-experts model, :mod:`core_rl_train_kit.moe`) a
:class:`~core_rl_train_kit.moe.RouteRecorder` keeps the experts every router chose: at the prefill for
each prompt token, at decoding step ``t`` for response token ``t - 1`` (the token it feeds). A
completion's ``routed_experts`` ``[len(prompt) + len(tokens), L, K]`` holds them in that order, -1
on its last token (never fed). Rows dropped by ``keep`` are followed by their original index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import attrs
import torch
from core_rl.interfaces import SamplingParams
from core_rl_train_kit.moe import NO_ROUTE, ROUTE_DTYPE, RouteRecorder, route_shape

from core_rl_hf.decode import (
    LeanStepper,
    TransformersStepper,
    advance,
    compiled_advance,
    lean_supported,
    make_stepper,
    mixed_precision,
)
from core_rl_hf.decode_state import DecodeState
from core_rl_hf.graphs import DecodeGraphs, bucketed_capacity, bucketed_rows
from core_rl_hf.kv_cache import output_cache
from core_rl_hf.stop_check import StopStringCheck


@attrs.define
class Completion:
    """One generated response: token ids, their behaviour log-probs, and ``"stop"``/``"length"``
    (or ``"abort"``: interrupted, see :func:`generate_batch`); ``routed_experts``: the routes of its
    prompt and response tokens (CPU, int16 ``[prompt + response, L, K]``) where they were recorded."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = None


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-align ``prompts`` into ``(input_ids, attention_mask, position_ids)``, each [B, L].

    ``position_ids`` is ``cumsum(attention_mask) - 1`` on real tokens and 0 on padding.
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if prompt:
            input_ids[i, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    sampling: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
    interrupted: Callable[[], bool] | None = None,
    lean: bool = True,
    compute_dtype: torch.dtype | None = None,
    sync_every: int = 1,
    graphs: DecodeGraphs | None = None,
    max_rows: int | None = None,
    decode_text: Callable[[Sequence[int]], str] | None = None,
    generated: Sequence[int] | None = None,
    record_routes: bool = False,
    compile_steps: bool = False,
) -> list[list[Completion]]:
    """``counts[i]`` responses to each (non-empty) ``prompts[i]``, all generated as one batch; see
    the module docstring. ``sampling.n`` is ignored (``counts`` says how many). ``lean``: decode
    supported architectures with :class:`core_rl_hf.decode.LeanStepper`; ``compute_dtype``: mixed
    precision (the prefill under autocast, the steps as :mod:`core_rl_hf.decode` describes).
    ``sync_every``: the host reads how many rows are done every this many tokens;
    ``graphs``: replay the decoding step from CUDA graphs kept there (lean models only), the rows
    rounded up to a power of two but at most ``max_rows`` (:func:`~core_rl_hf.graphs.bucketed_rows`).
    ``decode_text``: token ids to text (special tokens left out), with which rows stop at
    ``sampling.stop`` strings at the host's checks (:mod:`core_rl_hf.stop_check`). ``generated``:
    per prompt, how many of its last tokens are a response so far (a continued sample), which the
    frequency and presence penalties count as generated (default none). ``record_routes``: each
    completion carries its ``routed_experts`` (module docstring; the transformers stepper runs).
    ``compile_steps``: run the lean steps that no CUDA graph replays through
    :func:`core_rl_hf.decode.compiled_advance` (the step and the token choice after it)."""
    with RouteRecorder(model) if record_routes else contextlib.nullcontext() as recorder:
        return _generate(
            model,
            prompts,
            counts,
            sampling,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            generator=generator,
            interrupted=interrupted,
            lean=lean and not record_routes,
            compute_dtype=compute_dtype,
            sync_every=sync_every,
            graphs=None if record_routes else graphs,
            max_rows=max_rows,
            decode_text=decode_text,
            generated=generated,
            recorder=recorder,
            compile_steps=compile_steps,
        )


def _generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    counts: Sequence[int],
    sampling: SamplingParams,
    *,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None,
    interrupted: Callable[[], bool] | None,
    lean: bool,
    compute_dtype: torch.dtype | None,
    sync_every: int,
    graphs: DecodeGraphs | None,
    max_rows: int | None,
    decode_text: Callable[[Sequence[int]], str] | None,
    generated: Sequence[int] | None,
    recorder: RouteRecorder | None,
    compile_steps: bool,
) -> list[list[Completion]]:
    """:func:`generate_batch` (``recorder``: the routes' recorder, entered)."""
    device = next(model.parameters()).device
    stop_ids = sorted(set(eos_token_ids) | set(sampling.stop_token_ids))
    input_ids, attention_mask, position_ids = left_pad(prompts, pad_token_id, device)
    # one row per sample: each prompt's keys and values, mask and logits repeated counts[i] times
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.as_tensor(counts, device=device))
    width, steps, total = input_ids.shape[1], sampling.max_new_tokens, len(rows)
    lean = lean and lean_supported(model)
    graphed_rows = graphs is not None and graphs.usable and lean
    stepper: LeanStepper | TransformersStepper | None = None
    found, routes = None, None
    if lean and not graphed_rows:  # the lean path prefills too: no transformers cache to copy over
        stepper, first = LeanStepper.prefill(
            model, input_ids, attention_mask, position_ids, rows, width + steps, compute_dtype
        )
        logits, vocab = first[rows], first.shape[-1]
        del first
    else:
        with mixed_precision(model, compute_dtype):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
            )
        vocab = out.logits.shape[-1]
        routes = _DecodeRoutes(recorder, model, len(prompts), width, total, steps, device) if recorder else None
        if graphed_rows:  # a graph's rows: copies of the first row fill the batch up (done from the start)
            rows = torch.cat([rows, rows[:1].expand(bucketed_rows(total, max_rows) - total)])
        cache = output_cache(out)
        cache.reorder_cache(rows)
        logits = out.logits[rows, -1].float()
        mask, last_position = attention_mask[rows], position_ids[rows, -1:]
        del out

    def new_state() -> DecodeState:
        special = dict(stop_ids=stop_ids, pad_token_id=pad_token_id)
        return DecodeState(len(rows), steps, vocab, sampling, **special, device=device, generator=generator)

    if graphed_rows:
        capacity = bucketed_capacity(width + steps)
        key = (id(model), len(rows), vocab, _sampling_key(sampling), tuple(stop_ids), pad_token_id)
        key += (compute_dtype, id(generator))

        shared = graphs.weights(model, compute_dtype)
        shared.refresh(model)  # the weights may have changed since a kept graph last ran

        def build() -> tuple[LeanStepper, DecodeState]:
            stepper = LeanStepper(
                model, cache, mask, last_position, capacity, compute_dtype, static=True, weights=shared
            )
            return stepper, new_state()

        found = graphs.get(key, steps, capacity, build)  # None: the capture failed, decode eagerly
    if found is not None:
        graphed = found[0]
        stepper, state = graphed.stepper, graphed.state
        stepper.load(cache, mask, last_position)  # the capture's warm-up moved them on
        cache = None  # the prompts' keys and values are in the stepper's buffers now
        state.reset(steps, live=total, min_new_tokens=sampling.min_new_tokens)
        next_token, keep = graphed.replay, None
    else:
        if stepper is None:
            if len(rows) > total:  # no graph after all (its capture failed): the batch's own rows
                rows = rows[:total]
                cache.reorder_cache(torch.arange(total, device=device))
                logits, mask, last_position = logits[:total], mask[:total], last_position[:total]
            stepper = make_stepper(
                model, cache, mask, last_position, width + steps, lean=lean, compute_dtype=compute_dtype
            )
        eager = stepper
        state = new_state()
        compiled = compile_steps and isinstance(eager, LeanStepper)
        step_and_choose = compiled_advance() if compiled else advance

        def next_token() -> None:
            step_and_choose(eager, state, state.draw())
            if routes is not None:
                routes.after_step()

        def keep(rows: torch.Tensor) -> None:
            eager.keep(rows)
            state.keep(rows)
            if routes is not None:
                routes.keep(rows)

    if state.seen is not None:  # penalties: what each row's prompt holds
        response = _response_mask(generated, input_ids.shape).to(device)
        state.load_context(input_ids[rows], attention_mask[rows].bool(), response[rows])
    state.choose(logits)
    del logits  # [rows, vocab] float32: not kept through the decode
    check = None
    if sampling.stop and decode_text is not None:
        check = StopStringCheck(sampling.stop, decode_text, sampling.min_new_tokens, sync_every)
    aborted = _decode(state, next_token, steps, sync_every=sync_every, keep=keep, interrupted=interrupted, check=check)

    tokens_l, logprobs_l, lengths_l, stopped_l = state.results()
    completions = [
        Completion(
            token_ids=tokens_l[i][: lengths_l[i]],
            logprobs=logprobs_l[i][: lengths_l[i]],
            finish_reason="stop" if stopped_l[i] else ("abort" if aborted and lengths_l[i] < steps else "length"),
        )
        for i in range(total)
    ]
    if check is not None:  # exact, also for rows that ended on EOS or the budget since the last check
        completions = [check.cut(c) for c in completions]
    if routes is not None:
        source = rows[:total].tolist()  # the prompt of each row
        completions = [
            attrs.evolve(c, routed_experts=routes.of(i, source[i], len(prompts[source[i]]), len(c.token_ids)))
            for i, c in enumerate(completions)
        ]
    grouped, start = [], 0
    for count in counts:
        grouped.append(completions[start : start + count])
        start += count
    return grouped


class _DecodeRoutes:
    """The routes of one :func:`generate_batch` call: the prefill's ``[prompts, width, L, K]`` and
    each row's decoding steps' ``[total, steps, L, K]`` (-1 where no step ran), with the original
    row of each row still decoding (``keep`` drops rows)."""

    def __init__(
        self,
        recorder: RouteRecorder,
        model: torch.nn.Module,
        prompts: int,
        width: int,
        total: int,
        steps: int,
        device: torch.device,
    ) -> None:
        layers, top_k = route_shape(model)
        self.recorder = recorder
        self.prefill = recorder.take().reshape(prompts, width, layers, top_k).cpu()
        self.decode = torch.full((total, max(steps, 1), layers, top_k), NO_ROUTE, dtype=ROUTE_DTYPE, device=device)
        self.live = torch.arange(total, device=device)
        self.step = 0  # the response position the next decoding step feeds

    def after_step(self) -> None:
        """Keep the routes of the step just run (it fed response token ``self.step`` of each live row)."""
        taken = self.recorder.take()
        self.decode[self.live, self.step] = taken[: len(self.live)]
        self.step += 1

    def keep(self, rows: torch.Tensor) -> None:
        self.live = self.live[rows]

    def of(self, row: int, prompt: int, prompt_length: int, length: int) -> torch.Tensor:
        """Routes ``[prompt_length + length, L, K]`` of ``row`` (from prompt ``prompt``), its last
        token's -1."""
        width = self.prefill.shape[1]
        response = self.decode[row, :length].cpu().clone()
        if length > 0:
            response[-1] = NO_ROUTE
        return torch.cat([self.prefill[prompt, width - prompt_length :], response])


def _decode(
    state: DecodeState,
    advance: Callable[[], None],
    steps: int,
    *,
    sync_every: int,
    keep: Callable[[torch.Tensor], None] | None,
    interrupted: Callable[[], bool] | None,
    check: Callable[[DecodeState, int], None] | None = None,
) -> bool:
    """Generate tokens ``1 .. steps - 1`` (token 0 is chosen) with ``advance``, one step each.

    Every ``sync_every`` tokens the host reads how many rows are done (after ``check(state, t)``
    finished the rows it finds done: stop strings): all -> stop; at least a quarter and ``keep``
    given -> drop the finished rows. Nothing else is read back per token. ``interrupted()`` (a
    host-side flag) is asked before each token; when true the running rows end with the tokens
    they have. Returns whether that happened."""
    for t in range(1, steps):
        if t % sync_every == 0:
            if check is not None:
                check(state, t)
            finished, rows = state.finished(), len(state.done)
            if finished == rows:
                break
            if keep is not None and 4 * finished >= rows:
                keep((~state.done).nonzero().squeeze(-1))
        if interrupted is not None and interrupted():
            state.abort()
            return True
        advance()
    return False


def _response_mask(generated: Sequence[int] | None, shape: torch.Size) -> torch.Tensor:
    """bool ``shape`` [prompts, width] of right-aligned prompts: true on each prompt's last
    ``generated[i]`` tokens (all false when ``generated`` is ``None``)."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, count in enumerate(generated or ()):
        if count > 0:
            mask[i, shape[1] - count :] = True
    return mask


def _sampling_key(sampling: SamplingParams) -> tuple:
    """What a captured step depends on in ``sampling`` (the number of samples is not; greedy
    choice reads no temperature, top-k, top-p or min-p: :func:`core_rl_hf.sampling.choose_tokens`;
    the step reads ``min_new_tokens`` from the device, and depends only on whether it is positive).
    Temperature, top-k, top-p, min-p and the penalties are baked into a captured step as numbers,
    so a captured step is kept per value of each (greedy choice reads the penalties too)."""
    blocks_stops = sampling.min_new_tokens > 0
    penalties = (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty)
    if sampling.greedy:
        return (True, blocks_stops, *penalties)
    return (False, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, blocks_stops, *penalties)
