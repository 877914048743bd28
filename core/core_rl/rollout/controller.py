"""The rollout controller: keeps trajectories generating while the trainer trains, within a
staleness bound.

Prompts are drawn from the data in *generation batches* (waves) of ``data.batch_size``, in order;
wave ``w`` is what the trainer's ``w``-th request for a generation batch receives (first in, first
out, whatever order its trajectories finish in). Each prompt runs through the rollout workflow
(:mod:`core_rl.rollout.workflows`) on an asyncio loop in a thread of the controller's own.

Admission (staleness control at the start of a trajectory, so nothing stale is generated and then
dropped): a trajectory of wave ``w`` starts only while

    w <= version + max_head_offpolicyness + extra    and    w <= requested - 1 + max_head_offpolicyness

where ``version`` is the newest weight version the engine holds, ``requested`` the generation
batches the trainer asked for so far (the one it waits for included) and ``extra`` how many of
those were additional batches within a step (dynamic sampling). Every step takes at least one
wave, so a wave taken at step ``s`` (training version ``s - 1``) started under a version
``>= s - 1 - max_head_offpolicyness``: the oldest token of every trained sample lags the policy
by at most the bound. With bound 0 a wave starts only once the trainer asked for it and holds the
newest weights: the synchronous loop, and with ``batching: wave`` (one ``generate`` call per wave)
the very calls the synchronous loop made.

Further limits: at most ``max_concurrent_rollouts`` trajectories in flight, and in flight plus
finished-but-not-taken at most ``queue_size``.

Weight updates (:meth:`RolloutController.update_weights`) stop admission, pause the engine (in
``pause_mode``: ``abort`` interrupts running requests, which continue under the new weights, so
their later tokens carry the new version), load the weights and resume.

Deadlines: a trajectory's workflow call (``workflow.run``) that takes longer than
``rollout.controller.workflow_timeout_s`` stops the run with one line naming the workflow
(:class:`~core_rl.reliability.deadlines.DeadlinePassed`); a loop blocked that long (an ``async def`` of a workflow
or engine making a blocking call, which no timeout on the loop can cut) is found by a
:class:`~core_rl.reliability.loop_watch.LoopWatch` and stops the run the same way, naming where it is blocked.

Checkpoints: :meth:`state_dict` holds the data position before the first wave not yet taken (and
the dynamic-sampling count); a resumed run draws the in-flight waves again, so their prompts are
regenerated, neither lost nor repeated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from core_rl.config.schema import ControllerConfig
from core_rl.errors import CoreRLError, PluginFault, warn
from core_rl.interfaces import RolloutEngine, SamplingParams
from core_rl.interfaces.sampling import GuidedDecodingUnsupported, batch_key
from core_rl.plugins.attribution import built_by
from core_rl.protocol import Sample
from core_rl.reliability.deadlines import DeadlinePassed, deadline_message
from core_rl.reliability.loop_watch import LoopWatch
from core_rl.reliability.own_loop import awaitable_error
from core_rl.rollout.stop_strings import apply_stop_strings
from core_rl.rollout.workflows import ROW_MEDIA, RolloutWorkflow, WorkflowContext, check_samples

T = TypeVar("T")

#: what :func:`core_rl.rollout.workflows.check_samples` holds the engine's and the workflow's results to
AGENERATE_CONTRACT = "RolloutEngine.agenerate returns the sampling.n samples of the prompt it is given"
GENERATE_CONTRACT = "RolloutEngine.generate returns, for each prompt, its sampling.n samples, in prompt order"
RUN_CONTRACT = "RolloutWorkflow.run returns the trajectories of its prompt, each a Sample of prompt.prompt_ids"


def _awaitable_errors(call: Callable[..., T]) -> Callable[..., T]:
    """``call``, raising what it raises as an asyncio future can hold it
    (:func:`~core_rl.reliability.own_loop.awaitable_error`), so that awaiting it in an executor never
    waits for ever."""

    @functools.wraps(call)
    def guarded(*args: Any, **kwargs: Any) -> T:
        try:
            return call(*args, **kwargs)
        except StopIteration as exc:
            raise awaitable_error(exc) from exc

    return guarded


class RolloutTimeout(CoreRLError):
    """The trainer waited longer than ``rollout.controller.wait_timeout_s`` for the controller."""


class RolloutFailed(CoreRLError):
    """A trajectory's workflow or the rollout engine failed: the run failed (exit status 1)."""

    exit_code = 1


@attrs.define(eq=False)
class _Pending:
    """A generate call of a trajectory waiting for its wave's batch (``batching: wave``)."""

    slot: int
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    media: dict[str, Any] | None = None


@attrs.define(eq=False)
class _Wave:
    index: int
    prompts: list[Any]
    data_state: dict[str, Any]  # the data position before this wave was drawn
    groups: list[list[Sample] | None]
    start_versions: list[int] = attrs.field(factory=list)
    draw_metrics: dict[str, float] = attrs.field(factory=dict)  # what the data said of drawing it
    started: int = 0
    finished: int = 0
    pending: list[_Pending] = attrs.field(factory=list)

    @property
    def done(self) -> bool:
        return self.finished == len(self.prompts)


@attrs.define
class Wave:
    """A finished generation batch as the trainer receives it: ``prompts`` (in data order), the group of
    samples of each, the engine version each trajectory started under, metrics, and the data's ``draw_metrics()``."""

    index: int
    prompts: list[Any]
    groups: list[list[Sample]]
    start_versions: list[int]
    metrics: dict[str, float]
    draw_metrics: dict[str, float] = attrs.field(factory=dict)


class RolloutController:
    """See the module docstring.

    :param engine: the rollout engine (any :class:`RolloutEngine`).
    :param workflow: turns a prompt into a group of trajectories.
    :param data: the prompt source (``next_batch()``, ``state_dict()``, ``load_state_dict()``, optionally
        ``draw_metrics()``); an empty batch ends it, an error drawing fails the run after the waves drawn.
    :param sampling: the run's sampling settings, handed to the workflow.
    :param batch_size: prompts per wave (``data.batch_size``).
    :param generate_threads: torch intra-op threads of the thread that runs ``batching: wave``
        generation (the trainer's own count, so the numbers match a call from the trainer's thread).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        workflow: RolloutWorkflow,
        data: Any,
        sampling: SamplingParams,
        config: ControllerConfig,
        *,
        batch_size: int,
        tokenizer: Any = None,
        generate_threads: int | None = None,
    ) -> None:
        self.engine, self.workflow, self.data = engine, workflow, data
        self._engine_words = built_by(engine)
        self.sampling, self.config, self.batch_size = sampling, config, batch_size
        self.tokenizer = tokenizer
        self.bound = config.max_head_offpolicyness
        self.max_inflight = config.max_concurrent_rollouts or (self.bound + 1) * batch_size
        self.queue_size = config.queue_size or (self.bound + 1) * batch_size
        if self.queue_size < batch_size:
            raise CoreRLError(
                f"rollout.controller.queue_size={config.queue_size} is below data.batch_size={batch_size}: "
                "a generation batch could never be held whole; raise it (or set 0 for the default)"
            )
        self.wave_batching = config.batching == "wave" or (config.batching == "auto" and self.bound == 0)
        # -- state, touched on the loop thread only (after start) --------------------------------
        self._version = engine.weight_version
        self._requested = 0  # generation batches the trainer asked for (the pending one included)
        self._steps = 0  # steps the trainer started
        self._extra = 0  # additional batches asked for within a step (dynamic sampling)
        self._waves: deque[_Wave] = deque()  # drawn and not yet taken, in order
        self._next_wave = 0
        self._inflight = 0
        self._held = 0  # finished trajectories not yet taken
        self._updating = False
        self._error: BaseException | None = None
        self._draw_error: Exception | None = None  # the data's next_batch() failed: no wave after those drawn
        self._closed = False
        self._admitting = False  # between start() and close()
        self._tasks: set[asyncio.Task] = set()
        self._busy_s = 0.0  # rollout busy time (some trajectory in flight) since the last take
        self._busy_since: float | None = None
        self._last_take = time.perf_counter()
        self._changed: asyncio.Condition | None = None
        threads = generate_threads

        def init_thread() -> None:
            if threads:
                import torch

                torch.set_num_threads(threads)

        self._executor = concurrent.futures.ThreadPoolExecutor(1, "rollout-generate", initializer=init_thread)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-controller", daemon=True)
        self._thread.start()
        #: a workflow (or engine) that blocks the loop is found by this watch (core_rl/reliability/loop_watch.py)
        self._watch = LoopWatch(self._loop, self._thread, config.workflow_timeout_s)
        self._stalled = False
        self._call(self._setup(), 60, "the rollout controller's event loop to start")

    async def _setup(self) -> None:
        self._changed = asyncio.Condition()

    # -- trainer-facing calls (any thread but the loop's) ----------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        if self._closed:
            coro.close()
            raise CoreRLError("the rollout controller is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(min(1.0, max(deadline - time.monotonic(), 0.0)))
            except concurrent.futures.TimeoutError:
                if (stall := self._watch.stalled()) is not None:
                    future.cancel()
                    self._stalled = True
                    raise DeadlinePassed(
                        f"{built_by(self.workflow)}: the rollout controller's event loop, where the workflow runs, is "
                        f"{stall} (rollout.controller.workflow_timeout_s={self.config.workflow_timeout_s:g}): "
                        "an async def there makes a blocking call, so nothing on the loop can run or time out. "
                        "The run stops, keeping its last checkpoint; move the blocking call off the loop "
                        "(await asyncio.to_thread(...))"
                    ) from None
                if time.monotonic() < deadline:
                    continue
                future.cancel()
                raise RolloutTimeout(
                    f"rollout controller: waited {timeout:.0f} s for {what} "
                    f"(rollout.controller.wait_timeout_s={self.config.wait_timeout_s:g}); {self._describe()}"
                ) from None

    def _describe(self) -> str:
        waves = ", ".join(f"wave {w.index}: {w.started} started, {w.finished} finished" for w in self._waves)
        return (
            f"engine version {self._version}, {self._inflight} trajectories in flight, {self._held} held; "
            f"{waves or 'no wave drawn'}; engine health {self.engine.health()}"
        )

    def take(self, *, new_step: bool) -> Wave:
        """The next generation batch, blocking until all its trajectories finished. ``new_step``:
        the first request of a trainer step (later ones are dynamic sampling's extra batches)."""
        return self._call(
            self._take(new_step), self.config.wait_timeout_s, f"generation batch {self._requested} to finish"
        )

    @contextlib.contextmanager
    def paused(self, version: int) -> Iterator[None]:
        """Stop admitting and pause the engine (``pause_mode``) for the body, which loads the
        weights of ``version`` into the engine; then resume and admit under ``version``."""
        self._call(self._set_updating(True), 60, "admission to stop for a weight update")
        try:
            self.engine.pause(self.config.pause_mode)
            try:
                yield
            finally:
                self.engine.resume()
        finally:
            self._call(self._set_updating(False, version), 60, "admission to restart after a weight update")

    def update_weights(self, load: Callable[[], T], version: int) -> T:
        """:meth:`paused` around ``load()``; returns what it returned."""
        with self.paused(version):
            return load()

    def state_dict(self) -> dict[str, Any]:
        """The data position before the first wave not taken, and the dynamic-sampling count."""
        return self._call(self._state(), 60, "the controller's state")

    def load_state_dict(self, state: Mapping[str, Any], *, completed_steps: int) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`): the data position and counters of a
        run resumed after step ``completed_steps``."""
        if self._next_wave or self._waves:
            raise RuntimeError("load_state_dict() after the controller started")
        if "data" in state:
            self.data.load_state_dict(state["data"])
        self._extra = int(state.get("extra", 0))
        self._steps = completed_steps
        self._requested = self._next_wave = completed_steps + self._extra

    def start(self) -> None:
        """Start admitting trajectories (the first wave may begin before the trainer asks)."""
        self._call(self._start(), 60, "the controller to start")

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is in flight and stop the loop thread (joined within ``timeout``)."""
        if self._closed:
            return
        self._watch.stop()
        if self._stalled or self._watch.stalled() is not None:  # blocked for good: nothing to wait for
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._executor.shutdown(wait=False, cancel_futures=True)
            return

        async def stop() -> None:
            self._admitting = False
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout + 5)
        except Exception:
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            warn("the rollout controller's thread did not stop")

    # -- the loop thread -------------------------------------------------------------------------

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _start(self) -> None:
        self._admitting = True
        self._pump()

    async def _state(self) -> dict[str, Any]:
        data = self._waves[0].data_state if self._waves else self.data.state_dict()
        return {"data": dict(data), "extra": self._extra, "waves_taken": self._requested}

    async def _set_updating(self, updating: bool, version: int | None = None) -> None:
        self._updating = updating
        if version is not None:
            self._version = version
        if not updating:
            self._pump()
            await self._notify()

    async def _take(self, new_step: bool) -> Wave:
        assert self._changed is not None
        if new_step:
            self._steps += 1
        self._requested += 1
        self._extra = self._requested - self._steps
        self._pump()
        async with self._changed:
            await self._changed.wait_for(lambda: self._error is not None or self._ready_or_dry())
        error = self._error if self._error is not None or self._waves else self._draw_error
        if isinstance(error, CoreRLError):  # says what failed already (a PluginFault the engine or workflow, a server)
            raise error
        if error is not None:
            raise RolloutFailed(f"rollout failed: {type(error).__name__}: {error}") from error
        wave = self._waves.popleft()
        self._held -= len(wave.prompts)
        now = time.perf_counter()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        elapsed = max(now - self._last_take, 1e-9)
        self._busy_s, self._last_take = 0.0, now
        if self._busy_since is not None:
            self._busy_since = now
        self._pump()
        metrics = {
            "async/queue_groups": float(self._held),
            "async/inflight": float(self._inflight),
            "throughput/rollout_utilization": min(1.0, busy / elapsed),
            "async/engine_version": float(self._version),
        }
        groups = [g for g in wave.groups if g is not None]
        return Wave(wave.index, wave.prompts, groups, list(wave.start_versions), metrics, dict(wave.draw_metrics))

    def _ready_or_dry(self) -> bool:  # the first wave finished, or none left and the draw after them failed
        return self._waves[0].done if self._waves else self._draw_error is not None

    def _allowed(self, w: int) -> bool:
        return w <= self._version + self.bound + self._extra and w <= self._requested - 1 + self.bound

    def _pump(self) -> None:
        """Start every trajectory the limits allow (on the loop thread)."""
        while self._admitting and not self._updating and self._error is None:
            wave = next((w for w in self._waves if w.started < len(w.prompts)), None)
            if wave is None:
                if self._draw_error is not None or not self._allowed(self._next_wave):
                    return
                state = dict(self.data.state_dict())
                try:
                    prompts = list(self.data.next_batch())
                except Exception as exc:  # e.g. data.difficulty_filter finding nothing left: after the waves drawn
                    self._draw_error = exc
                    return
                if not prompts:  # a finite source (an evaluation's prompts) has ended
                    return
                drawn = getattr(self.data, "draw_metrics", dict)()
                wave = _Wave(self._next_wave, prompts, state, [None] * len(prompts), draw_metrics=drawn)
                self._waves.append(wave)
                self._next_wave += 1
            if not self._allowed(wave.index) or self._inflight >= self.max_inflight:
                return
            if self._inflight + self._held >= self.queue_size:
                return
            slot = wave.started
            wave.started += 1
            wave.start_versions.append(self._version)
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1
            task = self._loop.create_task(self._trajectory(wave, slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _stopped(self, samples: list[Sample], sampling: SamplingParams) -> list[Sample]:
        """``samples`` cut at ``sampling.stop`` strings (:mod:`core_rl.rollout.stop_strings`)."""
        if not sampling.stop:
            return samples
        if self.tokenizer is None:
            raise CoreRLError("rollout.sampling.stop: stop strings need the policy's tokenizer, which this run lacks")

        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

        return apply_stop_strings(samples, decode, sampling.stop, sampling.min_new_tokens)

    async def _trajectory(self, wave: _Wave, slot: int) -> None:
        prompt = wave.prompts[slot]
        row_media = getattr(prompt, "media", None)  # the prompt's images (a vision-language model's)

        async def generate(
            prompt_ids: Sequence[int], sampling: SamplingParams, *, media: Any = ROW_MEDIA
        ) -> list[Sample]:
            if media is ROW_MEDIA:
                media = row_media
            if sampling.response_format is not None and not getattr(self.engine, "guided_decoding", False):
                raise GuidedDecodingUnsupported(
                    f"{self._engine_words} has no guided decoding, so it cannot sample under a "
                    "response_format (structured output): use a rollout.engine that has it (vllm, sglang), or leave "
                    "response_format unset"
                )
            if self.wave_batching:
                samples = await self._wave_generate(wave, slot, prompt_ids, sampling, media)
            else:
                with_media = {"media": media} if media is not None else {}
                samples = await self.engine.agenerate(prompt_ids, sampling, **with_media)
                samples = self._checked(samples, prompt_ids, sampling.n, AGENERATE_CONTRACT)
            for sample in samples:  # generated with them, trained with them
                sample.media = media
            return self._stopped(samples, sampling)

        ctx = WorkflowContext(generate=generate, sampling=self.sampling, tokenizer=self.tokenizer)
        try:
            group = await self._run_workflow(prompt, ctx, f"run (prompt {slot} of generation batch {wave.index})")
            wave.groups[slot] = check_samples(
                group,
                built_by(self.workflow),
                "trajectories",
                prompt_ids=None if getattr(self.workflow, "own_prompts", False) else prompt.prompt_ids,
                count=None,
                contract=RUN_CONTRACT,
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._error is None:
                self._error = exc
        finally:
            self._inflight -= 1
            if self._inflight == 0 and self._busy_since is not None:
                self._busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None
            wave.finished += 1
            self._held += 1
            if self.wave_batching:
                self._flush_if_blocked(wave)
            if self._admitting:
                self._pump()
                await self._notify()

    async def _run_workflow(self, prompt: Any, ctx: WorkflowContext, doing: str) -> list[Sample]:
        """``workflow.run(prompt, ctx)`` within ``rollout.controller.workflow_timeout_s``; past it,
        :class:`~core_rl.reliability.deadlines.DeadlinePassed` naming the workflow and ``doing``."""
        timeout = self.config.workflow_timeout_s
        task = asyncio.ensure_future(self.workflow.run(prompt, ctx))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            raise DeadlinePassed(
                deadline_message(built_by(self.workflow), doing, timeout, "rollout.controller.workflow_timeout_s")
            )
        return task.result()

    # -- batching: wave --------------------------------------------------------------------------

    async def _wave_generate(
        self,
        wave: _Wave,
        slot: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        media: dict[str, Any] | None = None,
    ) -> list[Sample]:
        future = self._loop.create_future()
        wave.pending.append(_Pending(slot, list(prompt_ids), sampling, future, media))
        self._flush_if_blocked(wave)
        return await future

    def _flush_if_blocked(self, wave: _Wave) -> None:
        """Once every running trajectory of ``wave`` waits in ``generate``, send their calls to
        the engine as one batch per sampling setting, in slot order."""
        if not wave.pending or len(wave.pending) < wave.started - wave.finished:
            return
        pending = sorted(wave.pending, key=lambda p: p.slot)
        wave.pending = []
        batches: dict[tuple, list[_Pending]] = {}
        for p in pending:
            batches.setdefault(batch_key(p.sampling), []).append(p)
        task = self._loop.create_task(self._run_batches(list(batches.values())))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_batches(self, batches: list[list[_Pending]]) -> None:
        for batch in batches:
            try:
                generate = self.engine.generate
                if any(p.media is not None for p in batch):  # images: only engines claiming multimodal get here
                    generate = functools.partial(generate, media=[p.media for p in batch])
                groups = await self._loop.run_in_executor(
                    self._executor, _awaitable_errors(generate), [p.prompt_ids for p in batch], batch[0].sampling
                )
                checked = self._checked_groups(groups, batch)
            except BaseException as exc:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, group in zip(batch, checked):
                if not p.future.done():
                    p.future.set_result(group)

    def _checked_groups(self, groups: Any, batch: list[_Pending]) -> list[list[Sample]]:
        """What ``engine.generate`` returned for ``batch``: one group per call, each checked."""
        if not isinstance(groups, Sequence) or len(groups) != len(batch):
            got = f"{len(groups)} groups" if isinstance(groups, Sequence) else f"a {type(groups).__name__}"
            raise PluginFault(f"{self._engine_words} returned {got} for {len(batch)} prompts; {GENERATE_CONTRACT}")
        return [self._checked(g, p.prompt_ids, p.sampling.n, GENERATE_CONTRACT) for p, g in zip(batch, groups)]

    def _checked(self, samples: Any, prompt_ids: Sequence[int], n: int, contract: str) -> list[Sample]:
        """The ``n`` samples of ``prompt_ids`` the engine returned (:func:`core_rl.rollout.workflows.check_samples`)."""
        return check_samples(samples, self._engine_words, "samples", prompt_ids=prompt_ids, count=n, contract=contract)
