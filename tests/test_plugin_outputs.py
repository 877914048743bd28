"""What a plugin's component returns is checked where the core receives it (core_rl.plugins.guards,
core_rl.rollout.workflows.check_samples, the reward runner): a wrong shape, dtype or length is a
PluginFault naming the component and its distribution and what the contract asks, instead of a
shape mismatch deep in core_rl.ops or a silently wrong batch."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from core_rl.config.schema import ControllerConfig, RewardRunnerConfig
from core_rl.errors import PluginFault
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import (
    AdvantageEstimator,
    ImportanceCorrection,
    LossOutput,
    PolicyLoss,
    RejectionSampler,
    Reward,
    RewardScores,
    SampleFilter,
    SamplingParams,
)
from core_rl.loops.errors import RewardError
from core_rl.loops.rl.reward_runner import RewardRunner
from core_rl.plugins.guards import engine_metrics, engine_tensor
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ADVANTAGE, POLICY_LOSS, REJECTION_SAMPLER, ROLLOUT_ENGINE, SAMPLE_FILTER, WORKFLOW
from core_rl.rollout.controller import RolloutController
from core_rl.rollout.workflows import RolloutWorkflow, SingleTurnWorkflow
from core_rl.testing import make_reward_input, make_rl_batch
from core_rl.testing.faults import build_task, merged
from fault_helpers import train_here

DIST, VERSION = "core-rl-outputs-test", "0.2"
WHO = f"(distribution {DIST} {VERSION})"


class SequenceAdvantage(AdvantageEstimator):
    """One advantage per sequence, [B]: the per-token broadcast forgotten."""

    def __call__(self, batch):
        return batch["rewards"] - batch["rewards"].mean()


class RaisingAdvantage(AdvantageEstimator):
    def __call__(self, batch):
        raise KeyError("values")


class FloatFilter(SampleFilter):
    def __call__(self, batch):
        return torch.ones(batch.batch_size)  # 1.0 / 0.0 instead of True / False


class SumLoss(PolicyLoss):
    """Weights of the wrong shape, a per-sequence loss, metrics that are not numbers."""

    def loss_weights(self, response_mask):
        return response_mask.sum(dim=1)

    def prepare(self, batch):
        return {"mode": "fast"}

    def observe_step(self, metrics):
        return [metrics["entropy"]]

    def state_dict(self):
        return {"seen": 1}

    def __call__(self, batch, logprobs, entropy):
        return LossOutput(per_token_loss=logprobs.sum(dim=1))


class FloatKeepSampler(RejectionSampler):
    def __call__(self, proximal_logprobs, behave_logprobs, mask):
        return ImportanceCorrection(weight=torch.ones_like(mask), keep=mask.float())


class ForeignPromptWorkflow(RolloutWorkflow):
    """Generates from a prompt of its own instead of the row's."""

    async def run(self, prompt, ctx):
        return await ctx.generate([*prompt.prompt_ids, 5], ctx.sampling)


def make_short_engine(rollout, engine_config, *, model_path, run_dir):
    """The hf engine, returning one sample too few per prompt."""
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    class ShortEngine(HFRolloutEngine):
        def generate(self, prompts, sampling):
            return [group[:-1] for group in super().generate(prompts, sampling)]

    return ShortEngine(model_path, HFRolloutConfig(device="cpu", seed=0))


class OutputsPlugin:
    @hookimpl
    def core_rl_register_advantage_estimators(self, register: Register) -> None:
        register("per_sequence", lambda config: SequenceAdvantage(), description="[B] advantages")
        register("raising", lambda config: RaisingAdvantage(), description="raises")

    @hookimpl
    def core_rl_register_sample_filters(self, register: Register) -> None:
        register("float_filter", lambda config: FloatFilter(), description="a float keep-mask")

    @hookimpl
    def core_rl_register_policy_losses(self, register: Register) -> None:
        register("sum_loss", lambda config: SumLoss(), description="per-sequence")

    @hookimpl
    def core_rl_register_rejection_samplers(self, register: Register) -> None:
        register("float_keep", lambda config: FloatKeepSampler(), description="a float keep")

    @hookimpl
    def core_rl_register_workflows(self, register: Register) -> None:
        register("foreign_prompt", lambda config: ForeignPromptWorkflow(), description="another prompt")

    @hookimpl
    def core_rl_register_rollout_engines(self, register: Register) -> None:
        register("short_hf", make_short_engine, description="one sample short")


@pytest.fixture
def outputs_host() -> PluginHost:
    host = PluginHost(entry_points=[], environ={})
    host.register_plugin(OutputsPlugin(), distribution=DIST, version=VERSION)
    return host


def test_advantages_of_the_wrong_shape_stop_the_run_naming_the_estimator(tmp_path: Path, host: PluginHost) -> None:
    """A real run (fsdp, hf, ppo_clip, char_match) with an estimator returning [B] advantages."""
    pytest.importorskip("core_rl_grpo")
    host.register_plugin(OutputsPlugin(), distribution=DIST, version=VERSION)
    config = merged(build_task(tmp_path), algorithm={"name": "grpo", "advantage": {"name": "per_sequence"}})
    with pytest.raises(PluginFault) as info:
        train_here(config, host)
    expected = (
        f"advantage estimator 'per_sequence' {WHO} returned advantages as a float32 tensor of shape [8]; "
        "AdvantageEstimator.__call__ returns [B, T] = [8, <T>], the shape of the batch's response_mask: "
        "a floating-point tensor [8, <T>]"
    )
    pattern = re.escape(expected).replace(re.escape("<T>"), r"\d+")  # T: the longest prompt + response
    assert re.fullmatch(pattern, str(info.value)), str(info.value)


def test_an_exception_from_a_component_names_it(outputs_host: PluginHost) -> None:
    estimator = outputs_host.create(ADVANTAGE, "raising", None)
    with pytest.raises(PluginFault) as info:
        estimator(make_rl_batch())
    assert (
        str(info.value) == f"advantage estimator 'raising' {WHO} failed while computing advantages: KeyError: 'values'"
    )
    assert isinstance(info.value.__cause__, KeyError)


def test_a_filter_mask_must_be_bool(outputs_host: PluginHost) -> None:
    with pytest.raises(PluginFault) as info:
        outputs_host.create(SAMPLE_FILTER, "float_filter", None)(make_rl_batch(batch_size=6))
    assert str(info.value) == (
        f"sample filter 'float_filter' {WHO} returned its keep-mask as a float32 tensor of shape [6]; "
        "SampleFilter.__call__ returns one flag per row, [B] = [6]: a bool tensor [6]"
    )


def test_a_policy_loss_is_checked_in_every_call(outputs_host: PluginHost) -> None:
    loss = outputs_host.create(POLICY_LOSS, "sum_loss", None)
    batch = make_rl_batch(batch_size=6, prompt_len=4, max_response_len=6)
    with pytest.raises(PluginFault, match=r"returned loss weights as a float32 tensor of shape \[6\]; .* \[6, 10\]"):
        loss.loss_weights(batch["loss_mask"])
    with pytest.raises(PluginFault, match=r"returned the metrics of prepare with 'mode': 'fast'"):
        loss.prepare(batch)
    with pytest.raises(
        PluginFault, match=r"returned the metrics of observe_step as a list, .*: a mapping of names to numbers"
    ):
        loss.observe_step({"entropy": 1.0})
    assert loss.state_dict() == {"seen": 1}  # what checkpoints save is the loss's own
    logprobs = batch["old_logprobs"]
    with pytest.raises(PluginFault) as info:
        loss(batch, logprobs, torch.zeros_like(logprobs))
    assert str(info.value) == (
        f"policy loss 'sum_loss' {WHO} returned per_token_loss as a float32 tensor of shape [6]; PolicyLoss.__call__ "
        "returns a LossOutput whose tensors are [b, T] = [6, 10], like logprobs: a floating-point tensor [6, 10]"
    )


def test_a_rejection_samplers_keep_mask_must_be_bool(outputs_host: PluginHost) -> None:
    sampler = outputs_host.create(REJECTION_SAMPLER, "float_keep", None)
    batch = make_rl_batch(batch_size=2)
    with pytest.raises(PluginFault, match=r"rejection sampler 'float_keep' .* returned keep as a float32 tensor"):
        sampler(batch["old_logprobs"], batch["behave_logprobs"], batch["response_mask"])


def test_a_train_engines_log_probs_and_metrics_are_checked() -> None:
    class Engine:
        def compute_logprobs(self, batch, *, temperature=1.0):
            return batch["old_logprobs"][:, :-1]

        def train_step(self, batch, loss_fn, *, temperature=1.0):
            return [("loss", 0.1)]

    batch = make_rl_batch(batch_size=3, prompt_len=2, max_response_len=3)
    with pytest.raises(PluginFault, match=r"Engine returned reference log-probs as a float32 tensor of shape \[3, 4\]"):
        engine_tensor(Engine(), "compute_logprobs", "reference log-probs", batch, temperature=1.0)
    with pytest.raises(PluginFault, match=r"returned the metrics of train_step as a list, not a tensor; TrainEngine"):
        engine_metrics(Engine(), "train_step", batch, None)


def test_rollout_outputs_are_checked_at_the_controller(tmp_path: Path, outputs_host: PluginHost) -> None:
    """The real controller on the hf engine: an engine returning n - 1 samples, then a workflow
    whose trajectories answer another prompt."""
    pytest.importorskip("core_rl_hf")
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    model = str(build_tiny_model(tmp_path / "model", alphabet="abcd=", seed=0))
    short = outputs_host.create(ROLLOUT_ENGINE, "short_hf", None, None, model_path=model, run_dir=tmp_path)
    engine = HFRolloutEngine(model, HFRolloutConfig(device="cpu", seed=0))
    foreign = outputs_host.create(WORKFLOW, "foreign_prompt", None)
    messages = [take_fault(short, SingleTurnWorkflow()), take_fault(engine, foreign)]
    short.close()
    engine.close()
    assert messages == [
        f"rollout engine 'short_hf' {WHO} returned 2 samples where 3 were due; RolloutEngine.generate returns, "
        "for each prompt, its sampling.n samples, in prompt order",
        f"rollout workflow 'foreign_prompt' {WHO} returned trajectories whose item 0 has prompt_ids [1, 2, 3, 5]... "
        "(4 tokens), not the prompt's (3 tokens); RolloutWorkflow.run returns the trajectories of its prompt, each a "
        "Sample of prompt.prompt_ids",
    ]


def take_fault(engine: Any, workflow: RolloutWorkflow) -> str:
    """The message of the PluginFault the first generation batch of a controller raises."""
    controller = RolloutController(
        engine, workflow, Prompts(), SamplingParams(n=3, max_new_tokens=3), ControllerConfig(), batch_size=2
    )
    controller.start()
    try:
        with pytest.raises(PluginFault) as info:
            controller.take(new_step=True)
    finally:
        controller.close()
    return str(info.value)


class Prompts:
    """Batches of two prompts ``[1, 2, 3]``."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> list[Any]:
        from types import SimpleNamespace

        self.position += 2
        return [SimpleNamespace(prompt_ids=[1, 2, 3], row={}, text="") for _ in range(2)]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_reward_parts_need_one_value_per_item() -> None:
    class Parted(Reward):
        def score(self, items):
            return [1.0 for _ in items]

        def score_with_parts(self, items):
            return RewardScores(scores=self.score(items), parts={"found": [1.0]})

    runner = RewardRunner(Parted(), "parted", RewardRunnerConfig())
    try:
        with pytest.raises(RewardError, match=r"reward 'parted' returned part 'found' with 1 values for 3 items"):
            runner.score([make_reward_input("a"), make_reward_input("b"), make_reward_input("c")])
    finally:
        runner.close()
