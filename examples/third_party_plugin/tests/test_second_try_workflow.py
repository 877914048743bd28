"""The ``second_try`` workflow: its conformance contract, its score by hand, the trajectories it
builds on a real tiny model through core-rl's rollout controller and ``hf`` engine (feedback
tokens masked, rewards equal to the environment's rule), and a real GRPO run through core-rl's
``train`` that trains on the rewards it assigns (``reward: {name: workflow}``).

The run is a fresh interpreter doing what ``core-rl train`` does; it registers the plugin module
itself when the plugin is not installed (core-rl's own test run reads it from the source tree)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import core_rl_example_plugin.plugin as plugin
import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import WorkflowContract, installed_distribution
from core_rl.testing.tiny import build_tiny_model
from core_rl_example_plugin.config import SecondTryConfig
from core_rl_example_plugin.workflow import SecondTryWorkflow, position_score

ALPHABET = "abcdef="


class TestSecondTryContract(WorkflowContract):
    plugin = plugin
    name = "second_try"
    distribution = installed_distribution("core-rl-example-plugin")


def test_position_score_by_hand() -> None:
    assert position_score("cba", "cba") == 1.0
    assert position_score("cbx", "cba") == pytest.approx(2 / 3)
    assert position_score("c", "cba") == pytest.approx(1 / 3)
    assert position_score("abcde", "dcba") == 0.0
    assert position_score("anything", "") == 1.0


def expected_reward(info: dict, credit: float) -> float:
    """The environment's rule, recomputed from the answers the workflow recorded."""
    answer = info["answer"]
    first = position_score(info["answers"][0], answer)
    if first == 1.0:
        return 1.0
    return credit * position_score(info["answers"][1], answer)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("second_try") / "model", alphabet=ALPHABET, seed=0)


class Prompt:
    def __init__(self, text: str, answer: str, tokenizer) -> None:
        self.text, self.row = text, {"answer": answer}
        self.prompt_ids = tokenizer.encode(text)


class Data:
    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts, self.position = prompts, 0

    def next_batch(self) -> list[Prompt]:
        out = self.prompts[self.position : self.position + 4]
        self.position += 4
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state) -> None:
        self.position = state["position"]


def test_trajectories_on_a_real_engine(model) -> None:
    hf = pytest.importorskip("core_rl_hf.engine")
    from core_rl.config.schema import ControllerConfig
    from core_rl.interfaces import SamplingParams
    from core_rl.rollout.controller import RolloutController
    from core_rl_hf.config import HFRolloutConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = hf.HFRolloutEngine(model, HFRolloutConfig(device="cpu", seed=0))
    config = SecondTryConfig(feedback="==", second_try_credit=0.5)
    feedback = tokenizer.encode("==", add_special_tokens=False)
    prompts = [Prompt(f"{s}=", s[::-1], tokenizer) for s in ("abc", "fed", "aab", "cde")]
    sampling = SamplingParams(n=4, max_new_tokens=4, temperature=1.0)
    controller = RolloutController(
        engine,
        SecondTryWorkflow(config),
        Data(prompts),
        sampling,
        ControllerConfig(wait_timeout_s=120),
        batch_size=4,
        tokenizer=tokenizer,
    )
    controller.start()
    try:
        wave = controller.take(new_step=True)
    finally:
        controller.close()
        engine.close()
    turns = []
    assert [p.text for p in wave.prompts] == [p.text for p in prompts]
    for prompt, group in zip(wave.prompts, wave.groups):
        assert len(group) == 4
        for sample in group:
            assert sample.prompt_ids == prompt.prompt_ids
            info = {**sample.info, "answer": prompt.row["answer"]}
            assert sample.reward == pytest.approx(expected_reward(info, 0.5))
            turns.append(info["turns"])
            n_first = len(tokenizer.encode(info["answers"][0], add_special_tokens=False))
            if info["turns"] == 1:
                assert sample.token_mask is None or all(sample.token_mask)
                continue
            # the first answer (and its stop token, if any), then the masked feedback, then the second try
            mask = sample.token_mask
            start = mask.index(0)
            assert start >= n_first
            assert mask[start : start + len(feedback)] == [0] * len(feedback)
            assert sample.response_ids[start : start + len(feedback)] == feedback
            assert all(mask[start + len(feedback) :]) and all(mask[:start])
            assert all(lp == 0.0 for lp in sample.logprobs[start : start + len(feedback)])
    assert 2 in turns  # a random policy rarely answers perfectly at once


def test_grpo_trains_on_the_rewards_the_workflow_assigns(model, tmp_path, train_run) -> None:
    pytest.importorskip("core_rl_hf")
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_grpo")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("abc", "fed", "aab", "cde"))
    )
    config = {
        "experiment": {"name": "second_try", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"lr": 1e-3}},
        "rollout": {
            "engine": {"name": "hf"},
            "sampling": {"n": 4, "max_new_tokens": 4},
            "workflow": {"name": "second_try", "feedback": "=", "second_try_credit": 0.5},
        },
        "algorithm": {"name": "grpo"},
        "reward": {"name": "workflow"},
        "trainer": {"total_steps": 3, "torch_threads": 1},
        "sample_log": {"every_n_steps": 1, "num_samples": 8},
        "saver": {"export_hf": False},
        "loggers": [{"name": "jsonl"}],
    }
    run_dir = train_run(config)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    answers = {f"{s}=": s[::-1] for s in ("abc", "fed", "aab", "cde")}
    for step in (1, 2, 3):
        logged = [s for s in samples if s["step"] == step]
        assert len(logged) == 8  # every sample of the step
        for s in logged:
            info = {"turns": s["info/turns"], "answers": s["info/answers"], "answer": answers[s["prompt"]]}
            assert s["reward"] == pytest.approx(expected_reward(info, 0.5))
        # the step's reward metric is the mean of the rewards the workflow assigned
        row = next(r for r in metrics if r["step"] == step)
        assert math.isclose(row["reward/mean"], sum(s["reward"] for s in logged) / 8, abs_tol=1e-6)
