"""Every example configuration with every installed algorithm switched on the command line
(``core-rl config validate <example> algorithm.name=<name>``): it validates, or each problem either
names the keys that disagree with where each value was set, or names a key the selected algorithm
needs that the example lacks (``<key>: required; ...``). An example written for the RL loop
validates with every recipe of the RL loop, but for what such a recipe requires in addition and the
pairs listed in :data:`INCOMPATIBLE`."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.config import load_config
from core_rl.errors import ConfigError
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))
HOST = PluginHost()
ALGORITHMS = HOST.available_names(ALGORITHM)


#: (example, algorithm) pairs of the RL loop that cannot go together, with a message naming both sources
INCOMPATIBLE = {
    # DAPO's dynamic sampling filters groups before the reward_model: role has scored them
    ("tiny_supervised/grpo_rm.yaml", "dapo"),
}


def _loop_of(algorithm: str | None) -> str:
    """The training loop an algorithm's recipe selects (``rl`` unless it names another)."""
    if algorithm is None:
        return "rl"
    defaults = build_component(HOST.get(ALGORITHM, algorithm)).defaults
    return defaults.get("trainer", {}).get("loop", {}).get("name", "rl")


def _own_algorithm(example: Path) -> str | None:
    return load_config(example, [], host=HOST, require_complete=False, notify=lambda _: None).algorithm.name


def test_the_matrix_covers_every_example_and_recipe():
    assert len(EXAMPLES) >= 20 and {"grpo", "gspo", "dapo", "ppo", "dpo", "sft", "rm"} <= set(ALGORITHMS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_algorithm_on_the_command_line(example: Path):
    rl_example = _loop_of(_own_algorithm(example)) == "rl"
    unexplained = {}
    for algorithm in ALGORITHMS:
        try:
            load_config(example, [f"algorithm.name={algorithm}"], host=HOST, notify=lambda _: None)
            continue
        except ConfigError as exc:
            problems = exc.problems
        required = [p for p in problems if p.partition(": ")[2].startswith("required")]
        explained = [p for p in problems if "(values: " in p and p not in required]
        name = str(example.relative_to(ROOT / "examples"))
        if rl_example and _loop_of(algorithm) == "rl" and (name, algorithm) not in INCOMPATIBLE:
            wrong = [p for p in problems if p not in required]  # nothing but what the recipe needs besides
        else:
            wrong = [p for p in problems if p not in required and p not in explained]
        if wrong:
            unexplained[algorithm] = wrong
    assert unexplained == {}
