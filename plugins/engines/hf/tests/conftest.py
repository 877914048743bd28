"""Shared fixtures: a tiny offline Llama model and a builder for ``hf`` engines on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.testing.tiny import build_tiny_model

if TYPE_CHECKING:  # imported where used: a machine without the plugin skips its tests (the root conftest)
    from core_rl_hf.engine import HFRolloutEngine


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf_tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_gpt2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 (learned *absolute* position embeddings, unlike Llama's RoPE, whose
    attention is unchanged when every position shifts by the same padding offset)."""
    from core_rl.testing.tiny import build_char_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("hf_gpt2") / "model"
    tokenizer = build_char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(params=["llama", "gpt2"])
def any_model_path(request: pytest.FixtureRequest) -> Path:
    """The tiny Llama and the tiny GPT-2, in turn."""
    return request.getfixturevalue("tiny_model_path" if request.param == "llama" else "tiny_gpt2_path")


@pytest.fixture
def make_engine(tiny_model_path: Path) -> Iterator[Callable[..., HFRolloutEngine]]:
    """``make_engine(path=None, **options)``: an engine on ``path`` (default: the tiny model) with
    ``options`` validated like a YAML ``rollout.engine`` section; closed after the test."""
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    made: list[HFRolloutEngine] = []

    def make(path: Path | None = None, **options: Any) -> HFRolloutEngine:
        config = structure({"device": "cpu", **options}, HFRolloutConfig, path="rollout.engine")
        engine = HFRolloutEngine(path or tiny_model_path, config)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(scope="session")
def tiny_state_dict(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights (a fresh copy per session; tests derive modified weights from it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="session")
def next_token_logits(tiny_model_path: Path) -> Callable[..., torch.Tensor]:
    """``next_token_logits(prompt, state_dict=None)``: float32 logits [V] of the token after
    ``prompt`` from a plain transformers forward of the tiny model (with ``state_dict`` loaded)."""
    from transformers import AutoModelForCausalLM

    def logits(prompt: list[int], state_dict: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        if state_dict is not None:
            model.load_state_dict(state_dict)
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()

    return logits
