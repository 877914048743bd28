"""CUDA graphs of the decoding step: capture once per batch shape, replay once per token.

A decoding step on a GPU is a few hundred small kernels (per layer: norms, projections, rotary
embedding, cache writes, attention, MLP; then the output head and sampling), each launched from
Python: at batch sizes of rollouts the GPU waits on the launches. :class:`GraphedDecoder` records
one step, ``state.choose(stepper.step(state.feed))`` (a static :class:`~core_rl_hf.decode.LeanStepper`
and a :class:`~core_rl_hf.decode_state.DecodeState`: fixed shapes, buffers updated in place, no
host synchronisation), as a CUDA graph; each later token is one ``replay``.

Cost: once per shape, one eager step (warm-up on a side stream) and one capture, about the time
of a few eager steps (:attr:`DecodeGraphs.capture_seconds` adds them up); the captured
intermediates live in the graph's private memory pool, and the entry keeps the key/value buffers
of ``rows x capacity`` positions between calls. Per token: one graph launch instead of the
kernels' launches; the attention covers all ``capacity`` positions (masked) instead of those
written so far. :class:`DecodeGraphs` keeps the last :data:`MAX_GRAPHS` shapes used.

Few shapes, so few captures: a batch's rows are rounded up to a power of two
(:func:`bucketed_rows`; the extra rows repeat the first one and are done from the start), its
positions to a multiple of :data:`CAPACITY_BUCKET`, and a batch is replayed by any kept graph of its
rows with at least its positions and tokens to generate (the smallest such). Batches of varying
sizes (an asynchronous rollout takes what is queued; the samples a ``pause("abort")`` interrupted
continue with the tokens they have left) then reuse a handful of graphs instead of capturing one
per call; at worst a batch pays the per-token cost of the batch that captured the graph it uses.

Sampling under the graph draws from the engine's generator (registered with the graph) or
torch's default CUDA generator: each replay advances the generator's offset as an eager step
would, so a seeded engine samples reproducibly. The warm-up's draws are undone (the generator's
state is restored after the capture, and after a failed one).

A capture that fails (an operation CUDA graphs cannot hold, in a model or torch this was not
measured with) ends graph use for the engine: with ``cuda_graphs: null`` it says so once and
decodes eagerly from then on; with ``cuda_graphs: true`` (``required``) it raises, naming the
setting.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from core_rl_hf.decode import LeanStepper, StepperWeights
from core_rl_hf.decode_state import DecodeState

log = logging.getLogger(__name__)

#: captured shapes kept per engine (each holds its key/value buffers)
MAX_GRAPHS = 4
#: capacities are rounded up to a multiple of this, so prompts of similar widths share a graph
CAPACITY_BUCKET = 64


def bucketed_capacity(positions: int) -> int:
    """``positions`` rounded up to a multiple of :data:`CAPACITY_BUCKET`."""
    return -(-positions // CAPACITY_BUCKET) * CAPACITY_BUCKET


def bucketed_rows(rows: int, limit: int | None = None) -> int:
    """``rows`` rounded up to a power of two (the rows of a captured batch), but not beyond
    ``limit`` (the engine's ``max_batch_size``: the memory a batch may take) unless ``rows`` is."""
    rounded = 1 << max(rows - 1, 0).bit_length()
    return rounded if limit is None else max(rows, min(rounded, limit))


class GraphedDecoder:
    """One decoding step of ``stepper`` (static) and ``state`` captured as a CUDA graph."""

    def __init__(self, stepper: LeanStepper, state: DecodeState) -> None:
        if not stepper.static:
            raise ValueError("only a static LeanStepper can be captured")
        self.stepper, self.state = stepper, state
        self.graph = self._capture()

    def _advance(self) -> None:
        self.state.choose(self.stepper.step(self.state.feed))

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warm up, then capture :meth:`_advance`; the sampling generator's state is restored
        afterwards (the warm-up drew from it), also when the capture fails."""
        device = self.state.feed.device
        # the capture begins on the current device's stream: make the engine's device current (it
        # need not be, e.g. rollout.engine.device cuda:1 beside a trainer on cuda:0)
        with torch.cuda.device(device):
            rng = self.state.generator or torch.cuda.default_generators[torch.cuda.current_device()]
            rng_state = rng.get_state()
            try:
                return self._capture_on(device)
            finally:
                rng.set_state(rng_state)

    def _capture_on(self, device: torch.device) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS workspaces...) happen here
            self._advance()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.state.generator is not None:  # the default generator is registered by the capture itself
            graph.register_generator_state(self.state.generator)
        # thread_local: CUDA work of other threads (a train engine beside an async rollout) may go on
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
            self._advance()
        return graph

    def replay(self) -> None:
        """One token for every row: the captured step."""
        self.graph.replay()


class DecodeGraphs:
    """The captured decoders of one engine, by key (the rows and everything else the captured step
    depends on) and size (tokens to generate, positions), at most :data:`MAX_GRAPHS` (least recently
    used dropped before a new one is captured, so no more are ever held). ``required``: a failed
    capture raises (``cuda_graphs: true``) instead of ending graph use (:attr:`failure` says why)."""

    def __init__(self, limit: int = MAX_GRAPHS, *, required: bool = False) -> None:
        self.limit, self.required = limit, required
        #: (key, steps, capacity) -> the decoder captured for them
        self._entries: OrderedDict[tuple[Hashable, int, int], GraphedDecoder] = OrderedDict()
        self.captures = 0
        self.capture_seconds = 0.0
        self.failure: str | None = None
        #: (model, compute dtype) -> the projection copies every kept graph of that model reads
        self._weights: dict[tuple[int, torch.dtype], StepperWeights] = {}

    def weights(self, model: torch.nn.Module, dtype: torch.dtype | None) -> StepperWeights:
        """The one :class:`~core_rl_hf.decode.StepperWeights` of ``model`` in ``dtype`` (default: its
        own) that the graphs captured here share; up to date only after its ``refresh``."""
        dtype = dtype or model.lm_head.weight.dtype
        key = (id(model), dtype)
        if key not in self._weights:
            self._weights = {k: v for k, v in self._weights.items() if k[0] == id(model)}  # another model's: gone
            self._weights[key] = StepperWeights.of(model, dtype)
        return self._weights[key]

    @property
    def usable(self) -> bool:
        """False once a capture has failed: the engine decodes eagerly."""
        return self.failure is None

    def find(self, key: Hashable, steps: int, capacity: int) -> tuple[Hashable, int, int] | None:
        """The kept entry for ``key`` with at least ``steps`` tokens and ``capacity`` positions, the
        smallest such (by positions, then tokens); ``None`` when there is none."""
        fits = [e for e in self._entries if e[0] == key and e[1] >= steps and e[2] >= capacity]
        return min(fits, key=lambda e: (e[2], e[1])) if fits else None

    def get(
        self, key: Hashable, steps: int, capacity: int, build: Callable[[], tuple[LeanStepper, DecodeState]]
    ) -> tuple[GraphedDecoder, bool] | None:
        """A decoder for ``key`` with at least ``steps`` tokens and ``capacity`` positions (:meth:`find`),
        else one captured from ``build()`` (a stepper of ``capacity`` positions and a state of ``steps``
        tokens); and whether it is new. ``None`` when the capture failed and graphs are not
        :attr:`required` (see the module docstring)."""
        found = self.find(key, steps, capacity)
        if found is not None:
            self._entries.move_to_end(found)
            return self._entries[found], False
        while len(self._entries) >= self.limit:
            self._entries.popitem(last=False)
        start = time.perf_counter()
        try:
            stepper, state = build()
            entry = GraphedDecoder(stepper, state)
            torch.cuda.synchronize(state.feed.device)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if self.required:
                raise RuntimeError(
                    f"rollout.engine.cuda_graphs: true, but capturing the decoding step failed ({reason}); set "
                    "cuda_graphs to null (decodes eagerly where a capture fails) or false"
                ) from exc
            self.failure = reason
            self.clear()
            log.warning("hf rollout engine: capturing the decoding step failed (%s); decoding eagerly from now", reason)
            return None
        seconds = time.perf_counter() - start
        self.captures += 1
        self.capture_seconds += seconds
        log.info(
            "hf rollout engine: captured the decoding step for %d rows x %d positions in %.2f s",
            len(state.feed),
            stepper.capacity,
            seconds,
        )
        self._entries[(key, steps, capacity)] = entry
        return entry, True

    def clear(self) -> None:
        self._entries.clear()
