"""The out-of-tree example plugin (examples/third_party_plugin), installed for real from its wheel.

The wheel is installed with ``pip install --no-deps --target`` into a temporary directory, and the
``core-rl`` command runs in a subprocess of this environment with that directory on ``PYTHONPATH``:
the plugin is then discovered through its entry points exactly as after ``pip install``, and this
environment is left untouched. Without the directory on ``PYTHONPATH`` the plugin is not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path
from typing import Any

import attrs
import packaging_utils as pu
import pytest
import yaml
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALGORITHM, POLICY_LOSS, ROLLOUT_ENGINE, TRAIN_ENGINE, PluginKind

pytestmark = pytest.mark.slow  # builds and installs a wheel, then runs about a dozen core-rl commands

DIST = "core-rl-example-plugin"
ADVANTAGE_LABEL = "advantage estimator"
REWARD_LABEL = "reward"
# What the YAML below selects besides the example plugin: core-rl's default engines, a loss, and
# the recipe the example's README combines with rank_advantage.
OTHER_COMPONENTS: tuple[tuple[PluginKind, str], ...] = (
    (TRAIN_ENGINE, "fsdp"),
    (ROLLOUT_ENGINE, "hf"),
    (POLICY_LOSS, "ppo_clip"),
    (ALGORITHM, "grpo"),
)

CONFIG: dict[str, Any] = {
    "experiment": {"name": "example-plugin"},
    "actor": {"model_path": "/models/tiny", "engine": {"name": "fsdp"}},  # validate reads no files
    "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4}},
    "algorithm": {"advantage": {"name": "rank_advantage"}, "loss": {"name": "ppo_clip"}},
    "reward": {"name": "keyword_reward", "keywords": ["paris", "france"]},
    "data": {"train_files": ["prompts.jsonl"]},
    "loggers": [{"name": "console"}],
}


@attrs.frozen
class Sites:
    """``plugin``: a directory holding only the installed example plugin; ``base``: the in-repo
    plugins the config needs that this environment lacks (often empty); ``missing``: components
    the config needs that neither provides (validation then cannot succeed)."""

    plugin: Path
    base: Path
    config: Path
    missing: tuple[str, ...]

    @property
    def with_plugin(self) -> list[Path]:
        return [self.plugin, self.base]

    @property
    def without_plugin(self) -> list[Path]:
        return [self.base]


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Sites:
    root = tmp_path_factory.mktemp("third_party")
    host = PluginHost(environ={})
    providers: set[Path] = set()
    missing = []
    for kind, name in OTHER_COMPONENTS:
        if name in host.available_names(kind):
            continue
        provider = pu.find_provider(kind.group, name)
        if provider is None:
            missing.append(f"{kind.label} {name!r}")
        else:
            providers.add(provider)
    wheels = pu.build_wheels([pu.EXAMPLE_PLUGIN_DIR, *sorted(providers)], root / "wheels")
    plugin = pu.install_into_target([wheels[DIST]], root / "plugin")
    base = pu.install_into_target([wheels[pu.distribution_name(p)] for p in sorted(providers)], root / "base")
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    return Sites(plugin=plugin, base=base, config=config, missing=tuple(missing))


def require_complete(sites: Sites) -> None:
    if sites.missing:
        pytest.skip(
            f"the config also needs {', '.join(sites.missing)}, which neither this environment nor a plugin "
            "project of this repository provides yet"
        )


def problems(stderr: str) -> list[str]:
    """The problem lines of a ``core-rl: error: invalid configuration`` message."""
    return [line[4:] for line in stderr.splitlines() if line.startswith("  - ")]


def rows_by_name(rows: list[dict[str, str]]) -> dict[tuple[str, str], dict[str, str]]:
    return {(row["kind"], row["name"]): row for row in rows}


def test_core_rl_plugins_lists_both_components(sites: Sites) -> None:
    rows = rows_by_name(pu.plugin_rows(pu.cli(sys.executable, "plugins", "--json", pythonpath=sites.with_plugin)))
    for key in ((ADVANTAGE_LABEL, "rank_advantage"), (REWARD_LABEL, "keyword_reward")):
        assert key in rows, sorted(rows)
        row = rows[key]
        assert row["distribution"] == DIST
        assert row["version"] == pu.read_pyproject(pu.EXAMPLE_PLUGIN_DIR)["project"]["version"]
        assert row["status"] == "loaded"
        assert row["description"]


def test_the_wheel_declares_the_entry_points_and_bounds(sites: Sites) -> None:
    dist = next(md.distributions(path=[str(sites.plugin)]))
    assert dist.metadata["Name"] == DIST
    assert {(ep.group, ep.name, ep.value) for ep in dist.entry_points} == {
        ("core_rl.advantage_estimators", "rank_advantage", "core_rl_example_plugin.plugin"),
        ("core_rl.rewards", "keyword_reward", "core_rl_example_plugin.plugin"),
        ("core_rl.loops", "prompt_lm", "core_rl_example_plugin.plugin"),
        ("core_rl.workflows", "second_try", "core_rl_example_plugin.plugin"),
    }
    requires = {req.split(";")[0].replace(" ", "") for req in dist.requires or []}
    assert "core-rl<0.2,>=0.1" in requires, requires
    assert "torch<2.14,>=2.11" in requires, requires


def test_config_selecting_the_plugin_validates(sites: Sites) -> None:
    require_complete(sites)
    proc = pu.cli(sys.executable, "config", "validate", sites.config, pythonpath=sites.with_plugin)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{sites.config}: valid"


def test_config_show_fills_in_the_plugin_defaults(sites: Sites) -> None:
    require_complete(sites)
    proc = pu.cli(sys.executable, "config", "show", sites.config, "reward.mode=all", pythonpath=sites.with_plugin)
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["algorithm"]["advantage"] == {
        "name": "rank_advantage",
        "scale": 1.0,
        "allow_single_sample_groups": False,
    }
    assert shown["reward"] == {
        "name": "keyword_reward",
        "keywords": ["paris", "france"],
        "row_key": None,
        "mode": "all",
        "case_sensitive": False,
        "whole_words": True,
    }


def test_a_recipe_with_the_plugin_advantage(sites: Sites, tmp_path: Path) -> None:
    """The example README's usage: the grpo recipe with its advantage estimator replaced."""
    require_complete(sites)
    config = {
        **CONFIG,
        "algorithm": {"name": "grpo", "advantage": {"name": "rank_advantage", "scale": 2.0}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = pu.cli(sys.executable, "config", "show", path, pythonpath=sites.with_plugin)
    assert proc.returncode == 0, proc.stderr
    algorithm = yaml.safe_load(proc.stdout)["algorithm"]
    assert algorithm["advantage"] == {
        "name": "rank_advantage",
        "scale": 2.0,
        "allow_single_sample_groups": False,
    }  # no options of the recipe's own
    assert algorithm["loss"]["name"] == "ppo_clip"  # from the recipe


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.advantage.scael=2", "reward.mode=most"],
            [
                "algorithm.advantage.scael: unknown key; did you mean 'scale'?",
                "reward.mode: must be one of 'fraction', 'all', got 'most'",
            ],
        ),
        (
            ["algorithm.advantage.scale=-1", "reward.keywrods=[x]"],
            [
                "algorithm.advantage.scale: must be > 0, got -1.0",
                "reward.keywrods: unknown key; did you mean 'keywords'?",
            ],
        ),
    ],
)
def test_bad_plugin_options_fail_naming_each_key(sites: Sites, overrides: list[str], expected: list[str]) -> None:
    proc = pu.cli(sys.executable, "config", "validate", sites.config, *overrides, pythonpath=sites.with_plugin)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    found = problems(proc.stderr)
    for problem in expected:
        assert problem in found, proc.stderr


def test_without_the_plugin_the_config_fails_listing_installed_names(sites: Sites) -> None:
    try:
        md.distribution(DIST)
    except md.PackageNotFoundError:
        pass
    else:
        pytest.skip(f"{DIST} is installed in this environment itself, so it cannot be left out")
    rows = pu.plugin_rows(pu.cli(sys.executable, "plugins", "--json", pythonpath=sites.without_plugin))
    proc = pu.cli(sys.executable, "config", "validate", sites.config, pythonpath=sites.without_plugin)
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    found = problems(proc.stderr)
    for path, label, name, group in (
        ("algorithm.advantage", ADVANTAGE_LABEL, "rank_advantage", "core_rl.advantage_estimators"),
        ("reward", REWARD_LABEL, "keyword_reward", "core_rl.rewards"),
    ):
        installed = sorted(row["name"] for row in rows if row["kind"] == label)
        assert name not in installed
        expected = (
            f"{path}.name: {label} {name!r} is not installed (installed: {', '.join(installed) or 'none'}); "
            f"no core-rl extra provides it; install the distribution that registers {name!r} in "
            f"entry-point group {group}"
        )
        assert expected in found, proc.stderr


def test_blocked_plugin_is_reported_and_cannot_be_selected(sites: Sites) -> None:
    # a comma-separated list; distribution names match case-insensitively
    env = {"CORE_RL_PLUGINS_BLOCK": "some-other-dist, Core-RL-Example-Plugin"}
    listed = pu.cli(sys.executable, "plugins", "--json", pythonpath=sites.with_plugin, extra_env=env)
    rows = rows_by_name(pu.plugin_rows(listed))
    for key in ((ADVANTAGE_LABEL, "rank_advantage"), (REWARD_LABEL, "keyword_reward")):
        assert rows[key]["distribution"] == DIST
        assert rows[key]["status"].startswith("blocked"), rows[key]
    assert rows[("logger", "console")]["status"] == "loaded"

    proc = pu.cli(sys.executable, "config", "validate", sites.config, pythonpath=sites.with_plugin, extra_env=env)
    assert proc.returncode == 2, proc.stdout
    found = problems(proc.stderr)
    assert (
        f"algorithm.advantage.name: advantage estimator 'rank_advantage' is provided by {DIST}, which is blocked "
        "by CORE_RL_PLUGINS_BLOCK or not in CORE_RL_PLUGINS_ALLOW; unset or change that variable to use it"
    ) in found, proc.stderr
    assert any(p.startswith("reward.name: reward 'keyword_reward' is provided by") for p in found), proc.stderr


def test_allow_list_without_the_plugin_blocks_it(sites: Sites) -> None:
    env = {"CORE_RL_PLUGINS_ALLOW": "some-other-dist"}
    rows = rows_by_name(
        pu.plugin_rows(pu.cli(sys.executable, "plugins", "--json", pythonpath=sites.with_plugin, extra_env=env))
    )
    assert rows[(ADVANTAGE_LABEL, "rank_advantage")]["status"].startswith("blocked")
    assert rows[("logger", "jsonl")]["status"] == "loaded"  # core-rl's built-ins are always allowed
    env = {"CORE_RL_PLUGINS_ALLOW": DIST}
    rows = rows_by_name(
        pu.plugin_rows(pu.cli(sys.executable, "plugins", "--json", pythonpath=sites.with_plugin, extra_env=env))
    )
    assert rows[(ADVANTAGE_LABEL, "rank_advantage")]["status"] == "loaded"


def test_the_plugin_own_tests_pass_against_the_installed_wheel(sites: Sites) -> None:
    """Installed, the plugin's contracts also check its declared entry points: nothing is skipped."""
    proc = pu.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        env=pu.clean_env(pythonpath=[sites.plugin]),
        cwd=pu.EXAMPLE_PLUGIN_DIR,
        timeout=pu.CLI_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, proc.stdout[-4000:]
