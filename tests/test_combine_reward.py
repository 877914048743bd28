"""The built-in ``combine`` reward and the nested plugin sections it relies on: each part validated
by its own plugin with full key paths, built through the loader's registry entry, scored
concurrently, and reported as its own part."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import attrs
import pytest
import yaml
from core_rl.builtin import rewards as builtin_rewards
from core_rl.builtin.rewards import CombinedReward
from core_rl.config.loader import load_config, to_plain, validate_plugin_section
from core_rl.config.schema import PluginSpec
from core_rl.errors import ConfigError, PluginError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward, RewardScores
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REWARD
from core_rl.protocol import RewardInput
from core_rl.testing import RewardContract, make_reward_input

match_plugin = pytest.importorskip("core_rl_reward_match.plugin")

ROW = {"answer": "abcd"}


class TestCombineContract(RewardContract):
    plugin = builtin_rewards
    name = "combine"
    distribution = "core-rl"
    extra_plugins: ClassVar[list[object]] = [match_plugin]
    options: ClassVar[dict[str, Any]] = {
        "parts": [
            {"reward": {"name": "char_match"}, "weight": 0.75},
            {"reward": "exact_match", "weight": 0.25},
        ]
    }
    examples: ClassVar[list[tuple[RewardInput, float]]] = [
        (make_reward_input("abcd", ROW), 1.0),  # 0.75 * 1 + 0.25 * 1
        (make_reward_input("abcx", ROW), 0.5625),  # 0.75 * 3/4
        (make_reward_input("ab", ROW), 0.375),  # 0.75 * 2/4
        (make_reward_input("zzzz", ROW), 0.0),
    ]


# -- test rewards -----------------------------------------------------------------------------


@attrs.define
class BarrierConfig:
    value: float = 1.0


class Recorder:
    """A plugin with rewards that record how they were called."""

    def __init__(self, parties: int = 2) -> None:
        self.barrier = threading.Barrier(parties, timeout=20)
        self.threads: set[str] = set()

    @hookimpl
    def core_rl_register_rewards(self, register: Register) -> None:
        recorder = self

        class Meet(Reward):
            """Waits until every part is being scored at once (fails if scored one after another)."""

            def __init__(self, config: BarrierConfig) -> None:
                self.value = config.value

            def score(self, items):
                recorder.threads.add(threading.current_thread().name)
                recorder.barrier.wait()
                return [self.value] * len(items)

        class Flagged(Reward):
            def __init__(self, config: None) -> None:
                pass

            def score(self, items):
                return [float(len(i.response_text)) for i in items]

            def score_with_parts(self, items):
                return RewardScores(self.score(items), {"long": [float(len(i.response_text) > 2) for i in items]})

        class Broken(Reward):
            def __init__(self, config: None) -> None:
                pass

            def score(self, items):
                raise ZeroDivisionError("bad part")

        class Short(Reward):
            def __init__(self, config: None) -> None:
                pass

            def score(self, items):
                return [1.0] * (len(items) - 1)

        register("meet", Meet, description="meets the other parts", config_cls=BarrierConfig)
        register("flagged", Flagged, description="length, with a part")
        register("broken", Broken, description="raises")
        register("short", Short, description="one score too few")


def _host(recorder: Recorder | None = None) -> PluginHost:
    host = PluginHost(entry_points=[])
    host.register_plugin(builtin_rewards, distribution="core-rl")
    host.register_plugin(match_plugin, distribution="core-rl-reward-match")
    host.register_plugin(recorder or Recorder(), distribution="test")
    return host


def _build(options: dict[str, Any], host: PluginHost | None = None) -> CombinedReward:
    spec = PluginSpec(name="combine", options=options)
    validate_plugin_section(host or _host(), REWARD, spec, "reward")
    return spec.build()


def _problems(options: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _build(options)
    return info.value.problems


# -- configuration ----------------------------------------------------------------------------


def test_each_part_is_validated_by_its_own_plugin_with_full_paths():
    problems = _problems(
        {
            "parts": [
                {"reward": {"name": "char_match", "case_sensitive": "no"}},
                {"reward": {"name": "exact_match", "answr_key": "x"}, "weight": 0.5},
                {"reward": {"name": "no_such_reward"}},
            ]
        }
    )
    assert problems[0] == "reward.parts[0].reward.case_sensitive: expected true or false, got 'no'"
    assert problems[1] == "reward.parts[1].reward.answr_key: unknown key; did you mean 'answer_key'?"
    assert problems[2].startswith("reward.parts[2].reward.name: reward 'no_such_reward' is not installed")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"parts": []}, "reward.parts: must list at least one part"),
        ({"parts": [{"weight": 1.0}]}, "reward.parts[0].reward: required key is missing"),
        ({"parts": [{"reward": "exact_match", "weight": "heavy"}]}, "reward.parts[0].weight: expected a number"),
        (
            {"parts": [{"reward": "exact_match", "weight": float("inf")}]},
            "reward.parts[0].weight: expected a finite number",
        ),
        (
            {"parts": [{"reward": "exact_match"}, {"reward": {"name": "exact_match", "strip": False}}]},
            "reward.parts: must have distinct labels (exact_match repeated)",
        ),
        ({"parts": [{"reward": {"weight": 1}}]}, "reward.parts[0].reward.name: must name a registered plugin"),
    ],
)
def test_invalid_combine_sections(options, message):
    problems = _problems(options)
    assert any(p.startswith(message) for p in problems), problems


def test_nested_combine_validates_and_reports_nested_parts():
    reward = _build(
        {
            "parts": [
                {"reward": {"name": "char_match"}, "weight": 2.0},
                {
                    "label": "inner",
                    "weight": -1.0,
                    "reward": {
                        "name": "combine",
                        "parts": [{"reward": "exact_match", "weight": 0.5}, {"reward": "flagged", "weight": 0.0}],
                    },
                },
            ]
        }
    )
    result = reward.score_with_parts([make_reward_input("abcd", ROW), make_reward_input("ab", ROW)])
    assert result.scores == pytest.approx([2.0 - 0.5, 1.0 - 0.0])
    assert result.parts == {
        "char_match": [1.0, 0.5],
        "inner": [0.5, 0.0],
        "inner/exact_match": [1.0, 0.0],
        "inner/flagged": [4.0, 2.0],
        "inner/flagged/long": [1.0, 0.0],
    }
    assert result.answers == ["abcd", "ab"]  # the first part that reads answers (char_match: the response)


def test_a_nested_error_deep_inside_is_reported_with_its_path():
    problems = _problems(
        {"parts": [{"reward": {"name": "combine", "parts": [{"reward": {"name": "exact_match", "strip": 3}}]}}]}
    )
    assert problems == ["reward.parts[0].reward.parts[0].reward.strip: expected true or false, got 3"]


def test_whole_config_load_and_show_nested_defaults(host: PluginHost, minimal_config: dict, tmp_path):
    host.register_plugin(builtin_rewards, distribution="core-rl")
    path = tmp_path / "run.yaml"
    cfg = {**minimal_config, "experiment": {"seed": 2}, "reward": {"name": "combine", "parts": [{"weight": 0.5}]}}
    cfg["reward"]["parts"][0]["reward"] = {"name": "constant", "value": "${experiment.seed}"}  # interpolation
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config(path, ["experiment.seed=3"], host=host)
    assert to_plain(loaded)["reward"] == {
        "name": "combine",
        "parts": [{"reward": {"name": "constant", "value": 3.0, "scale": 1.0}, "weight": 0.5, "label": ""}],
        "num_workers": 0,
    }
    assert loaded.reward.build().score([make_reward_input("x")]) == [1.5]
    # a wrong nested value fails the whole load, with its path
    cfg["reward"]["parts"][0]["reward"]["scale"] = -1
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"reward\.parts\[0\]\.reward\.scale: must be > 0"):
        load_config(path, host=host)


def test_unvalidated_spec_cannot_be_built():
    with pytest.raises(PluginError, match="not validated by the configuration loader"):
        PluginSpec(name="exact_match").build()


# -- scoring ----------------------------------------------------------------------------------


def test_parts_are_scored_concurrently():
    recorder = Recorder(parties=2)
    reward = _build(
        {
            "parts": [
                {"reward": {"name": "meet", "value": 1.0}},
                {"reward": {"name": "meet", "value": 3.0}, "label": "b"},
            ]
        },
        _host(recorder),
    )
    # each part waits at a barrier for the other: this returns only if both run at the same time
    assert reward.score([make_reward_input("x")] * 3) == [4.0, 4.0, 4.0]
    assert len(recorder.threads) == 2


def test_num_workers_one_scores_parts_one_after_another():
    recorder = Recorder(parties=2)
    recorder.barrier = threading.Barrier(2, timeout=0.2)
    reward = _build(
        {
            "num_workers": 1,
            "parts": [{"reward": "meet"}, {"reward": "meet", "label": "b"}],
        },
        _host(recorder),
    )
    with pytest.raises(threading.BrokenBarrierError):
        reward.score([make_reward_input("x")])


def test_a_failing_part_is_named():
    reward = _build({"parts": [{"reward": "exact_match"}, {"reward": "broken", "label": "risky"}]})
    with pytest.raises(ZeroDivisionError) as info:
        reward.score([make_reward_input("abcd", ROW)])
    assert "in part 'risky' (reward 'broken') of reward 'combine'" in info.value.__notes__


def test_a_part_with_the_wrong_count_is_named():
    reward = _build({"parts": [{"reward": "short"}]})
    with pytest.raises(ValueError, match="part 'short' .* returned 1 scores for 2 items"):
        reward.score([make_reward_input("a"), make_reward_input("b")])
