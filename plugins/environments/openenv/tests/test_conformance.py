"""The core conformance kit run against the ``openenv`` environment, on the example game
(examples/digit_game.py, an OpenEnv ``Environment`` served locally by openenv-core's own
``create_app``): each guess answered higher/lower/correct with OpenEnv's per-step rewards. OpenEnv
runs in its own venv (built once from the plugin's default requirements)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import core_rl_openenv.plugin
import pytest
from core_rl.config.validators import FieldValueError
from core_rl.testing import EnvironmentContract
from core_rl_openenv.plugin import OpenEnvConfig
from openenv_game import GAME

ROW = {"prompt": "Guess:", "seed": 13}  # the secret is 3


class TestDigitGame(EnvironmentContract):
    plugin = core_rl_openenv.plugin
    name = "openenv"
    distribution = "core-rl-openenv"
    options: ClassVar[dict[str, Any]] = GAME
    fuzz_examples: ClassVar[int] = 5
    episodes: ClassVar[list] = [
        (ROW, ["3"], [1.0]),
        (ROW, ["1", "7", "3"], [0.1, 0.1, 1.0]),  # a wrong guess that is a digit: 0.1
        (ROW, ["x", "9", "88"], [0.0, 0.1, 0.0]),  # three wrong guesses end the game
        ({"prompt": "Guess:", "seed": 5}, ["5"], [1.0]),
    ]


def test_the_observation_as_json_without_a_text_field() -> None:
    import asyncio

    from core_rl.testing.environment_contracts import play

    config = OpenEnvConfig(**{**GAME, "observation_field": ""})
    env = core_rl_openenv.plugin.make_environment(config)

    async def first() -> str:
        observation = await env.reset(ROW)
        await env.close()
        return observation

    assert asyncio.run(first()) == '{"text": "Guess my digit (0-9):"}'
    results = asyncio.run(play(core_rl_openenv.plugin.make_environment(config), ROW, ["2"]))
    assert results[0].observation == '{"text": "higher"}'


def test_either_a_url_or_a_local_environment() -> None:
    with pytest.raises(FieldValueError, match="set either url"):
        OpenEnvConfig()
    with pytest.raises(FieldValueError, match="set either url"):
        OpenEnvConfig(url="http://127.0.0.1:1", environment="a:B", action="a:C", observation="a:D")
    with pytest.raises(FieldValueError, match="must be module:Name"):
        OpenEnvConfig(environment="digit_game.DigitGame", action="a:C", observation="a:D")


def test_the_example_is_a_valid_configuration(monkeypatch) -> None:
    from core_rl.config import load_config
    from core_rl.plugins import PluginHost

    plugin_dir = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(plugin_dir.parents[2])  # the example's paths are relative to the repository
    cfg = load_config(plugin_dir / "example.yaml", [], host=PluginHost(), notify=lambda _: None)
    assert cfg.rollout.workflow.name == "environment"
