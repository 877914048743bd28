"""The engine's own generator is part of its state: saved through a state tree (safetensors +
JSON) and restored, sampling continues exactly where it left off."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.checkpoint.files import load_tree, save_tree
from core_rl.errors import ConfigError
from core_rl.interfaces import SamplingParams

PROMPTS = [[1, 10, 11, 12], [1, 20, 21]]
SAMPLING = SamplingParams(n=3, max_new_tokens=6, temperature=1.0)


def responses(engine) -> list[list[int]]:
    return [s.response_ids for group in engine.generate(PROMPTS, SAMPLING) for s in group]


def test_generator_state_round_trips_through_a_checkpoint(make_engine, tmp_path: Path) -> None:
    first = make_engine(seed=5)
    responses(first)
    save_tree(tmp_path, "rollout", first.state_dict())
    expected = responses(first)

    second = make_engine(seed=5)
    assert responses(second) != expected  # a fresh generator draws the first call's samples again
    second.load_state_dict(load_tree(tmp_path, "rollout"))
    assert responses(second) == expected


def test_seed_mismatch_with_the_checkpoint_is_a_config_error(make_engine) -> None:
    seeded, unseeded = make_engine(seed=5), make_engine()
    assert "generator" not in unseeded.state_dict()
    with pytest.raises(ConfigError, match="rollout.engine.seed: not set"):
        unseeded.load_state_dict(seeded.state_dict())
    with pytest.raises(ConfigError, match="rollout.engine.seed: set"):
        seeded.load_state_dict(unseeded.state_dict())
