"""Fixtures: a tiny model with a chat template, its tokenizer, a real ``hf`` rollout engine, and
:func:`run_wave`, which runs one generation batch of the ``openai_agent`` workflow through core-rl's
rollout controller (the workflow's proxy is real, over HTTP on a free local port)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Prompt:
    def __init__(self, row: dict) -> None:
        self.row, self.text, self.prompt_ids = row, row["prompt"], [1]


class Rows:
    """The controller's data: ``rows`` in waves of ``size``."""

    def __init__(self, rows: list[dict], size: int) -> None:
        self.rows, self.size, self.position = rows, size, 0

    def next_batch(self) -> list[Prompt]:
        out = [Prompt(r) for r in self.rows[self.position : self.position + self.size]]
        self.position += self.size
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("proxy") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def engine(model):
    hf = pytest.importorskip("core_rl_hf.engine")
    from core_rl_hf.config import HFRolloutConfig

    engine = hf.HFRolloutEngine(model, HFRolloutConfig(device="cpu", seed=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def run_wave(engine, tokenizer):
    """``run_wave(rows, n=..., batching=..., sampling={...}, **workflow_options) -> (wave, workflow)``
    (``sampling``: more :class:`~core_rl.interfaces.SamplingParams` fields)."""
    from core_rl.config.schema import ControllerConfig
    from core_rl.interfaces import SamplingParams
    from core_rl.rollout.controller import RolloutController
    from core_rl_openai_proxy.config import OpenAIAgentConfig
    from core_rl_openai_proxy.workflow import OpenAIAgentWorkflow
    from proxy_agents import TEMPLATE

    workflows = []

    def run(
        rows: list[dict],
        *,
        n: int = 2,
        batching: str = "auto",
        max_new_tokens: int = 6,
        sampling: dict[str, Any] | None = None,
        **options: Any,
    ):
        config = OpenAIAgentConfig(**{"chat_template": TEMPLATE, "max_context_tokens": 120, **options})
        workflow = OpenAIAgentWorkflow(config)
        workflows.append(workflow)
        controller = RolloutController(
            engine,
            workflow,
            Rows(rows, len(rows)),
            SamplingParams(n=n, max_new_tokens=max_new_tokens, **(sampling or {})),
            ControllerConfig(wait_timeout_s=120, batching=batching),
            batch_size=len(rows),
            tokenizer=tokenizer,
        )
        controller.start()
        try:
            return controller.take(new_step=True), workflow
        finally:
            controller.close()

    yield run
    for workflow in workflows:
        workflow.close()
