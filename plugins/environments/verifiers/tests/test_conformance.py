"""The core conformance kits run against the ``verifiers`` environment and data source, on the
example tasksets (examples/tiny_arith.py: single-turn; examples/tiny_guess.py: a multi-turn ``Env``
that answers higher/lower), with rewards from the tasks' own ``@vf.reward`` functions. verifiers
runs in its own venv (built once from the plugin's default requirements)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import core_rl_verifiers.plugin
from core_rl.testing import DataSourceContract, EnvironmentContract
from vf_options import options

ARITH = options("tiny-arith", taskset_options={"size": 4})
GUESS = options("tiny-guess", taskset_options={"size": 4}, env_options={"max_guesses": 3})
#: rows of the sources above (their verifiers_key pins the task's content)
ARITH_ROWS = [
    {"prompt": "0+1=", "verifiers_idx": 0},
    {"prompt": "7+4=", "verifiers_idx": 1},
]
GUESS_ROW = {"prompt": "Guess my digit:", "verifiers_idx": 1}  # the secret is 3


class TestSource(DataSourceContract):
    plugin = core_rl_verifiers.plugin
    name = "verifiers"
    distribution = "core-rl-verifiers"
    options: ClassVar[dict[str, Any]] = ARITH
    expected_rows = 4
    columns: ClassVar[list[str]] = ["verifiers_idx", "verifiers_key"]


class TestSingleTurn(EnvironmentContract):
    plugin = core_rl_verifiers.plugin
    name = "verifiers"
    distribution = "core-rl-verifiers"
    options: ClassVar[dict[str, Any]] = ARITH
    fuzz_examples: ClassVar[int] = 5
    episodes: ClassVar[list] = [
        (ARITH_ROWS[0], ["1"], [1.0]),
        (ARITH_ROWS[1], ["7+4 = 11"], [1.0]),
        (ARITH_ROWS[1], ["12"], [0.0]),
        (ARITH_ROWS[1], [""], [0.0]),
    ]


class TestMultiTurn(EnvironmentContract):
    plugin = core_rl_verifiers.plugin
    name = "verifiers"
    distribution = "core-rl-verifiers"
    options: ClassVar[dict[str, Any]] = GUESS
    fuzz_examples: ClassVar[int] = 5
    episodes: ClassVar[list] = [
        (GUESS_ROW, ["3"], [1.75]),  # solved (1) + quick (0.5 x 1/1) + digits (0.25 x 1)
        (GUESS_ROW, ["1", "5", "3"], [0.0, 0.0, 1.0 + 0.5 / 3 + 0.25]),
        (GUESS_ROW, ["x", "4", "a9"], [0.0, 0.0, 0.25 / 2]),  # max_guesses spent; half the reply is digits
    ]


def test_an_env_with_a_second_model_role_is_refused_naming_the_role() -> None:
    """verifiers' user-sim Env: a simulated user (a model of its own) talks to the assistant."""
    import asyncio

    import pytest
    from core_rl_verifiers.plugin import VerifiersConfig, make_environment

    env = make_environment(VerifiersConfig(**options("tiny-arith", env="user-sim", role="assistant")))

    async def reset() -> str:
        try:
            return await env.reset(ARITH_ROWS[0])
        finally:
            await env.close()

    with pytest.raises(
        RuntimeError,
        match="uses its role 'user', which would need a model of its own; core-rl's policy plays only role 'assistant'",
    ):
        asyncio.run(reset())


def test_the_example_is_a_valid_configuration(monkeypatch) -> None:
    from core_rl.config import load_config
    from core_rl.plugins import PluginHost

    plugin_dir = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(plugin_dir.parents[2])  # the example's paths are relative to the repository
    cfg = load_config(plugin_dir / "example.yaml", [], host=PluginHost(), notify=lambda _: None)
    assert cfg.rollout.workflow.name == "environment"
