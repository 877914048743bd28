"""The rollout controller (core_rl.rollout.controller) on the embedded ``hf`` engine and a real tiny
model, driven by a trainer loop that takes generation batches and pushes new weight versions:
the staleness bound holds for every sample across bounds (hypothesis), every prompt arrives once
and in data order, interrupted requests change version at the interruption point, a failing
workflow is reported, a wait names what it waited for, and close() leaves no thread behind."""

from __future__ import annotations

import threading
import time

import attrs
import pytest
from core_rl.config.schema import ControllerConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.loops.rl.rollout_flow import staleness_metrics
from core_rl.rollout.controller import RolloutController, RolloutFailed
from core_rl.rollout.workflows import (
    RolloutWorkflow,
    SingleTurnWorkflow,
    WorkflowContext,
    append_observation,
    extend_turn,
)
from core_rl.testing.tiny import build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

core_rl_hf = pytest.importorskip("core_rl_hf")


class Prompt:
    def __init__(self, index: int, ids: list[int]) -> None:
        self.index, self.prompt_ids, self.row, self.text = index, ids, {"i": index}, str(index)


class CountingData:
    """Prompt ``i`` is ``[1 + i % 4, 2, 3]``; batches of ``batch_size`` in order."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.position = batch_size, 0

    def next_batch(self) -> list[Prompt]:
        out = [Prompt(i, [1 + i % 4, 2, 3]) for i in range(self.position, self.position + self.batch_size)]
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state) -> None:
        self.position = int(state["position"])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    model = build_tiny_model(tmp_path_factory.mktemp("ctl") / "model", alphabet="abcd=", seed=0)
    eng = HFRolloutEngine(model, HFRolloutConfig(device="cpu", seed=0, max_batch_size=64))
    yield eng
    eng.close()


def drive(controller: RolloutController, engine, steps: int, extra_at: set[int], bound: int) -> list[int]:
    """A trainer loop: per step one batch (two at steps in ``extra_at``), checks the bound, then a
    weight update to the step's version. Returns the prompt indices in the order received."""
    seen: list[int] = []
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for step in range(1, steps + 1):
        for k in range(2 if step in extra_at else 1):
            wave = controller.take(new_step=k == 0)
            for prompt, group, started in zip(wave.prompts, wave.groups, wave.start_versions):
                seen.append(prompt.index)
                assert len(group) == 2
                for sample in group:
                    oldest = min(sample.versions)
                    assert step - 1 - oldest <= bound, (step, oldest, bound)
                    assert oldest >= started
        controller.update_weights(lambda v=step: engine.update_weights(state, v), step)
    return seen


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bound=st.sampled_from([0, 1, 2, 4]),
    concurrency=st.sampled_from([0, 1, 3]),
    extra_at=st.sets(st.integers(1, 5), max_size=2),
)
def test_staleness_within_bound_and_each_prompt_once_in_order(engine, bound, concurrency, extra_at) -> None:
    engine._weight_version = 0  # a fresh run starts at version 0
    cfg = ControllerConfig(max_head_offpolicyness=bound, max_concurrent_rollouts=concurrency, pause_mode="abort")
    sampling = SamplingParams(n=2, max_new_tokens=6)
    controller = RolloutController(engine, SingleTurnWorkflow(), CountingData(3), sampling, cfg, batch_size=3)
    controller.start()
    try:
        seen = drive(controller, engine, 5, extra_at, bound)
    finally:
        controller.close()
    assert seen == list(range(len(seen)))  # nothing lost, nothing repeated, data order
    assert len(seen) == 3 * (5 + len(extra_at))


def test_bound_zero_draws_a_wave_only_when_asked(engine) -> None:
    engine._weight_version = 0
    data = CountingData(2)
    controller = RolloutController(
        engine, SingleTurnWorkflow(), data, SamplingParams(n=2, max_new_tokens=3), ControllerConfig(), batch_size=2
    )
    controller.start()
    try:
        time.sleep(0.2)
        assert data.position == 0  # synchronous: nothing generated ahead of the trainer
        controller.take(new_step=True)
        assert data.position == 2
        assert controller.state_dict()["data"] == {"position": 2}
    finally:
        controller.close()


def test_state_restores_in_flight_waves(engine) -> None:
    """A checkpoint taken while waves are in flight restores the position before them."""
    engine._weight_version = 0
    cfg = ControllerConfig(max_head_offpolicyness=2)
    sampling = SamplingParams(n=2, max_new_tokens=3)
    first = RolloutController(engine, SingleTurnWorkflow(), CountingData(2), sampling, cfg, batch_size=2)
    first.start()
    try:
        wave = first.take(new_step=True)
        first.update_weights(lambda: None, 1)
        time.sleep(0.3)  # let it draw ahead
        state = first.state_dict()
    finally:
        first.close()
    assert [p.index for p in wave.prompts] == [0, 1]
    assert state["data"] == {"position": 2}
    data = CountingData(2)
    second = RolloutController(engine, SingleTurnWorkflow(), data, sampling, cfg, batch_size=2)
    second.load_state_dict(state, completed_steps=1)
    second.start()
    try:
        assert [p.index for p in second.take(new_step=True).prompts] == [2, 3]
    finally:
        second.close()


class MultiTurn(RolloutWorkflow):
    """Two turns with a tool reply between them."""

    async def run(self, prompt, ctx: WorkflowContext):
        (first,) = await ctx.generate(prompt.prompt_ids, SamplingParams(n=1, max_new_tokens=2, min_new_tokens=2))
        sample = append_observation(first, [4, 4])
        (second,) = await ctx.generate(
            sample.prompt_ids + sample.response_ids, SamplingParams(n=1, max_new_tokens=2, min_new_tokens=2)
        )
        return [extend_turn(sample, second)]


@pytest.mark.parametrize("batching", ["wave", "request"])
def test_multi_turn_workflow_masks_tool_tokens(engine, batching) -> None:
    from core_rl.protocol import samples_to_batch

    engine._weight_version = 0
    cfg = ControllerConfig(batching=batching)
    controller = RolloutController(engine, MultiTurn(), CountingData(2), SamplingParams(), cfg, batch_size=2)
    controller.start()
    try:
        wave = controller.take(new_step=True)
    finally:
        controller.close()
    (sample,) = wave.groups[0]
    assert sample.response_ids[2:4] == [4, 4] and len(sample.response_ids) == 6
    assert sample.token_mask == [1, 1, 0, 0, 1, 1]
    batch = samples_to_batch([sample], [0], pad_token_id=0)
    p = len(sample.prompt_ids)
    assert batch["response_mask"][0, p : p + 6].tolist() == [1, 1, 0, 0, 1, 1]
    assert batch["versions"][0, p + 2 : p + 4].tolist() == [-1, -1]


class ExtraByParity(RolloutWorkflow):
    """Even prompts ask with one server parameter, odd ones with another."""

    async def run(self, prompt, ctx: WorkflowContext):
        extra = {"tag": "even" if prompt.index % 2 == 0 else "odd"}
        return await ctx.generate(prompt.prompt_ids, SamplingParams(n=1, max_new_tokens=2, extra=extra))


class RecordingEngine:
    """The real engine, recording each call's prompt count and ``extra`` and passing the call on
    without it (the hf engine samples in process and refuses server parameters)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.extra.get("tag")))
        return self.engine.generate(prompts, attrs.evolve(sampling, extra={}))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_wave_is_batched_apart_by_server_parameters(engine) -> None:
    """Requests of one wave that differ only in ``extra`` reach the engine as separate calls,
    equal ones together (``core_rl.interfaces.sampling.batch_key``)."""
    engine._weight_version = 0
    recording = RecordingEngine(engine)
    controller = RolloutController(
        recording, ExtraByParity(), CountingData(4), SamplingParams(), ControllerConfig(batching="wave"), batch_size=4
    )
    controller.start()
    try:
        wave = controller.take(new_step=True)
    finally:
        controller.close()
    assert sorted(recording.calls) == [(2, "even"), (2, "odd")]
    assert [len(group) for group in wave.groups] == [1, 1, 1, 1]


class Failing(RolloutWorkflow):
    async def run(self, prompt, ctx):
        raise ValueError("tool crashed")


def test_a_failing_workflow_is_reported(engine) -> None:
    controller = RolloutController(
        engine, Failing(), CountingData(2), SamplingParams(), ControllerConfig(), batch_size=2
    )
    controller.start()
    try:
        with pytest.raises(RolloutFailed, match="tool crashed"):
            controller.take(new_step=True)
    finally:
        controller.close()


@pytest.mark.timeout(120)
def test_a_fault_while_batching_a_wave_reaches_every_trajectory(engine, monkeypatch) -> None:
    """An error while keying a wave's requests (injected) fails the step with that error instead of
    leaving the wave's trajectories waiting for ever."""
    import core_rl.rollout.controller as controller_module

    def broken(sampling):
        raise TypeError("injected keying fault")

    monkeypatch.setattr(controller_module, "batch_key", broken)
    controller = RolloutController(
        engine,
        SingleTurnWorkflow(),
        CountingData(2),
        SamplingParams(n=1, max_new_tokens=2),
        ControllerConfig(),
        batch_size=2,
    )
    controller.start()
    try:
        with pytest.raises(RolloutFailed, match="injected keying fault"):
            controller.take(new_step=True)
    finally:
        controller.close()


class StopsIterating(RecordingEngine):
    """The real engine, whose ``generate`` raises ``StopIteration`` (as transformers does for a
    prompt with more image placeholders than images)."""

    def generate(self, prompts, sampling):
        raise StopIteration


@pytest.mark.timeout(120)
def test_an_engine_raising_stop_iteration_fails_the_step_at_once(engine) -> None:
    """asyncio drops a ``StopIteration`` copied into the future a wave awaits, which then waits until
    ``wait_timeout_s``; the controller raises it as an error the step fails with."""
    controller = RolloutController(
        StopsIterating(engine),
        SingleTurnWorkflow(),
        CountingData(2),
        SamplingParams(n=1, max_new_tokens=2),
        ControllerConfig(batching="wave", wait_timeout_s=100),
        batch_size=2,
    )
    controller.start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutFailed, match="StopIteration"):
            controller.take(new_step=True)
    finally:
        controller.close()
    assert time.monotonic() - started < 30


class RunsDry(CountingData):
    """Two waves (each reporting its draw), then a draw that raises, as ``data.difficulty_filter``
    does with nothing left to draw."""

    def next_batch(self) -> list[Prompt]:
        if self.position >= 2 * self.batch_size:
            raise CoreRLError("data.difficulty_filter: nothing left to draw")
        return super().next_batch()

    def draw_metrics(self) -> dict[str, float]:
        return {"data/skipped_easy": float(self.position)}


@pytest.mark.parametrize("bound", [0, 2])
def test_a_failing_draw_fails_the_take_that_needs_it(engine, bound) -> None:
    """Synchronous (the draw within the trainer's take) and asynchronous (drawn ahead, from a
    trajectory's completion): the waves drawn are taken with their draw metrics, and then the
    draw's error is raised to the trainer, not lost on the controller's thread (a hang)."""
    engine._weight_version = 0
    cfg = ControllerConfig(max_head_offpolicyness=bound, wait_timeout_s=20)
    sampling = SamplingParams(n=1, max_new_tokens=2)
    controller = RolloutController(engine, SingleTurnWorkflow(), RunsDry(2), sampling, cfg, batch_size=2)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    controller.start()
    try:
        for step in (1, 2):  # the waves drawn arrive with what their draw said
            assert controller.take(new_step=True).draw_metrics == {"data/skipped_easy": 2.0 * step}
            controller.update_weights(lambda v=step: engine.update_weights(weights, v), step)
        with pytest.raises(CoreRLError, match="nothing left to draw"):
            controller.take(new_step=True)
    finally:
        controller.close()


class Never(RolloutWorkflow):
    async def run(self, prompt, ctx):
        import asyncio

        await asyncio.sleep(3600)


def test_wait_times_out_naming_the_batch_and_close_stops_the_thread(engine) -> None:
    cfg = ControllerConfig(wait_timeout_s=2.0)  # time for the thread to start both on a loaded machine
    controller = RolloutController(engine, Never(), CountingData(2), SamplingParams(), cfg, batch_size=2)
    controller.start()
    try:
        with pytest.raises(CoreRLError, match=r"waited 2 s for generation batch 0 to finish.*2 trajectories in flight"):
            controller.take(new_step=True)
    finally:
        controller.close()
    assert not any(t.name == "rollout-controller" and t.is_alive() for t in threading.enumerate())


def test_queue_smaller_than_a_batch_is_refused(engine) -> None:
    with pytest.raises(CoreRLError, match="queue_size=1 is below data.batch_size=2"):
        RolloutController(
            engine,
            SingleTurnWorkflow(),
            CountingData(2),
            SamplingParams(),
            ControllerConfig(queue_size=1),
            batch_size=2,
        )


def test_staleness_metrics_by_hand() -> None:
    m = staleness_metrics([3, 2, 2, 1], [3, 3, 2, 1], trained_version=3)
    assert m["staleness/mean"] == pytest.approx(1.0)
    assert m["staleness/max"] == 2.0
    assert m["staleness/newest_mean"] == pytest.approx(0.75)
    assert m["staleness/interrupted_fraction"] == pytest.approx(0.25)
    assert [m[f"staleness/hist_{k}"] for k in range(3)] == [0.25, 0.5, 0.25]


def test_step_warnings_name_the_side_that_waited_and_do_not_repeat_every_step(capsys) -> None:
    from core_rl.config.schema import RunConfig
    from core_rl.loops.rl.rollout_flow import WARN_EVERY_STEPS, RolloutFlow

    cfg = RunConfig()
    cfg.rollout.controller.max_head_offpolicyness = 1
    flow = RolloutFlow(cfg, engine=None, workflow=None, data=None, sampling=None, tokenizer=None)
    flow._wait_s = 0.9
    metrics = {"timing/step_s": 1.0, "throughput/rollout_utilization": 0.2}
    assert flow.step_metrics(metrics, 1)["throughput/train_utilization"] == pytest.approx(0.1)
    err = capsys.readouterr().err
    assert "step 1: the trainer waited 0.9 s of the 1.0 s step for rollout" in err
    assert "step 1: rollout was idle 80% of the time, waiting on the trainer" in err
    flow.step_metrics(metrics, 2)
    assert capsys.readouterr().err == ""
    flow.step_metrics(metrics, 1 + WARN_EVERY_STEPS)
    assert capsys.readouterr().err.count("warning") == 2
    cfg.rollout.controller.max_head_offpolicyness = 0  # synchronous: waiting is by design
    flow._warned.clear()
    flow.step_metrics(metrics, 100)
    assert capsys.readouterr().err == ""


def test_a_workflow_past_its_deadline_stops_the_run_naming_it(engine) -> None:
    """``rollout.controller.workflow_timeout_s`` bounds each trajectory's ``run``: a workflow that
    hangs awaiting is cut there (well before ``wait_timeout_s``) with one line naming it."""
    from core_rl.reliability.deadlines import DeadlinePassed

    cfg = ControllerConfig(wait_timeout_s=300, workflow_timeout_s=1.0)
    controller = RolloutController(engine, Never(), CountingData(2), SamplingParams(), cfg, batch_size=2)
    controller.start()
    start = time.monotonic()
    try:
        with pytest.raises(
            DeadlinePassed, match=r"^Never: run \(prompt \d of generation batch 0\) did not return within 1 s "
        ):
            controller.take(new_step=True)
    finally:
        controller.close()
    assert time.monotonic() - start < 30
