"""A plugin's component is held to its interface when it is built (core_rl.plugins.components): a factory
that raises is reported as one line naming the component, its distribution and version, with the
plugin's own traceback below it (exit status 1: a bug in the plugin, not in the configuration);
a component written against an older interface is refused at once, naming what it lacks and which
interface version added it (not with an ``AttributeError`` at teardown)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import attrs
import packaging_utils as pu
import pytest
import yaml
from core_rl.config.schema import PluginSpec
from core_rl.errors import ConfigError, PluginFault
from core_rl.hookspecs import Register, hookimpl, interface_version
from core_rl.interfaces import Reward
from core_rl.plugins.components import build_component, check_contract, interface_class, interface_members, public_path
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALL_KINDS, REWARD, ROLLOUT_ENGINE, WORKFLOW
from core_rl.rollout.workflows import RolloutWorkflow
from core_rl.testing.faults import build_task, merged
from fault_helpers import train_here

DIST, VERSION = "core-rl-contracts-test", "2.5"


class FaultyReward:
    """A reward written before ``score_with_parts`` and ``close``: it does not subclass ``Reward``."""

    def __init__(self, config: Any) -> None:
        self.closed = False

    def score(self, items):
        return [0.0 for _ in items]


class OldEngine:
    """A rollout engine of interface version 1: batch generation and weight updates only."""

    weight_version = 0

    def generate(self, prompts, sampling):
        return []

    def update_weights(self, state_dict, version): ...

    def load_weights_from_path(self, path, version): ...

    def state_dict(self):
        return {}

    def load_state_dict(self, state): ...

    def close(self): ...


class SyncWorkflow(RolloutWorkflow):
    def run(self, prompt, ctx):  # type: ignore[override]  (a plain function: the controller awaits it)
        return []


def explode(config: Any) -> Reward:
    raise ValueError("scores.bin is missing from the reward's data directory")


def refuse(config: Any) -> Reward:
    raise ConfigError(["reward.threshold: must be below 1 for this reward"])


class ContractPlugin:
    @hookimpl
    def core_rl_register_rewards(self, register: Register) -> None:
        register("faulty", FaultyReward, description="an old reward")
        register("exploding", explode, description="a factory that raises")
        register("refusing", refuse, description="a factory reporting a configuration problem")

    @hookimpl
    def core_rl_register_rollout_engines(self, register: Register) -> None:
        register("old_engine", lambda *args, **kwargs: OldEngine(), description="a version-1 engine")

    @hookimpl
    def core_rl_register_workflows(self, register: Register) -> None:
        register("sync_workflow", lambda config: SyncWorkflow(), description="run is not async")


@pytest.fixture
def contract_host() -> PluginHost:
    host = PluginHost(entry_points=[], environ={})
    host.register_plugin(ContractPlugin(), distribution=DIST, version=VERSION)
    return host


def test_a_raising_factory_names_the_component_and_keeps_its_exception(contract_host: PluginHost) -> None:
    with pytest.raises(PluginFault) as info:
        contract_host.create(REWARD, "exploding", None)
    assert str(info.value) == (
        f"reward 'exploding' (distribution {DIST} {VERSION}) failed while building: "
        "ValueError: scores.bin is missing from the reward's data directory"
    )
    assert info.value.exit_code == 1
    assert isinstance(info.value.__cause__, ValueError)


def test_a_configuration_problem_from_a_factory_stays_one(contract_host: PluginHost) -> None:
    with pytest.raises(ConfigError, match="reward.threshold: must be below 1") as info:
        contract_host.create(REWARD, "refusing", None)
    assert info.value.exit_code == 2


def test_an_old_interface_reward_is_refused_when_built(contract_host: PluginHost) -> None:
    with pytest.raises(PluginFault) as info:
        PluginSpec(name="faulty", entry=contract_host.get(REWARD, "faulty")).build()
    assert str(info.value) == (
        f"reward 'faulty' (distribution {DIST} {VERSION}) does not implement core_rl.interfaces.Reward: its factory "
        "returned FaultyReward, which lacks score_with_parts(), close() (added in interface version 1); make it a "
        "subclass of core_rl.interfaces.Reward (which provides the optional members) or add them"
    )


def test_what_is_missing_is_grouped_by_the_interface_version_that_added_it(contract_host: PluginHost) -> None:
    with pytest.raises(PluginFault) as info:
        contract_host.create(ROLLOUT_ENGINE, "old_engine", None, None, model_path="m", run_dir=Path("."))
    assert (
        "which lacks weight_sync_modes, agenerate(), pause(), resume(), health(), update_weights_collective() "
        "(added in interface version 2); update_weights_from_buckets() (added in interface version 4); "
        "release_memory(), restore_memory() (added in interface version 6); fingerprint_dtypes(), "
        "fingerprint_prefix, weight_fingerprints() (added in interface version 9); guided_decoding (added in "
        "interface version 11); make it a subclass of "
        "core_rl.interfaces.RolloutEngine" in str(info.value)
    )
    assert interface_version("RolloutEngine", "agenerate") == 2
    assert interface_version("RolloutEngine", "generate") == 1
    assert interface_version("RolloutWorkflow", "run") == 3


def test_a_workflow_whose_run_is_not_async_is_refused(contract_host: PluginHost) -> None:
    with pytest.raises(PluginFault, match=r"rollout workflow 'sync_workflow' .* is not a coroutine function"):
        contract_host.create(WORKFLOW, "sync_workflow", None)


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda k: k.key)
def test_every_kind_is_checked_against_its_interface(kind, contract_host: PluginHost) -> None:
    """A factory returning nothing usable is refused for every kind, naming the interface."""
    interface = interface_class(kind)
    members = interface_members(interface)
    assert members, interface
    entry = contract_host.registries[REWARD.key].get("faulty")
    assert entry is not None
    # named where plugin authors import it from (core_rl.interfaces re-exports the reward contract)
    with pytest.raises(PluginFault, match=rf"does not implement {re.escape(public_path(interface))}: "):
        check_contract(attrs.evolve(entry, kind=kind), None)


def test_every_built_in_component_passes_its_contract() -> None:
    """The built-ins go through the same check (core's loggers, rewards, samplers, loop, workflow)."""
    host = PluginHost(environ={"CORE_RL_PLUGINS_ALLOW": "core-rl"})
    host.load_all()
    for kind in ALL_KINDS:
        for entry in host.registries[kind.key]:
            if entry.distribution != "core-rl" or kind.key in ("loop", "reward", "data_source"):  # a run / options
                continue
            if (kind.key, entry.name) == ("workflow", "environment"):  # needs an environment section: its own contract
                continue
            config = entry.config_cls() if entry.config_cls is not None else None
            build_component(entry, config)


def test_a_run_with_an_old_interface_reward_stops_before_training(tmp_path: Path, host: PluginHost) -> None:
    """Refused while the trainer builds it: no step runs, and closing the run does not fail on
    ``close``."""
    host.register_plugin(ContractPlugin(), distribution=DIST, version=VERSION)
    config = merged(build_task(tmp_path), reward={"name": "faulty"})
    with pytest.raises(PluginFault, match=r"reward 'faulty' .* lacks score_with_parts\(\), close\(\)"):
        train_here(config, host)
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_the_command_prints_one_line_then_the_plugins_traceback(tmp_path: Path) -> None:
    """``core-rl train`` with an installed plugin whose reward factory raises: exit status 1, the
    line naming the reward and its distribution, then the traceback of the plugin's own code."""
    site = pu.install_modules(
        tmp_path / "site",
        "core-rl-demo",
        "0.3.0",
        {"crl_demo_reward": EXPLODING_PLUGIN},
        "[core_rl.rewards]\nexploding = crl_demo_reward\n",
    )
    config = merged(build_task(tmp_path), reward={"name": "exploding"}, trainer={"total_steps": 1})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = pu.cli(sys.executable, "train", path, pythonpath=[site], extra_env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("core-rl: error:"))
    assert lines[first] == (
        "core-rl: error: reward 'exploding' (distribution core-rl-demo 0.3.0) failed while building: "
        "ValueError: scores.bin is missing from the reward's data directory"
    )
    assert lines[first + 1] == "Traceback (most recent call last):"
    assert f'File "{site / "crl_demo_reward.py"}", line 5, in make_reward' in lines[first + 2]
    assert lines[-1] == "ValueError: scores.bin is missing from the reward's data directory"
    assert proc.stderr.count("Traceback") == 1  # the plugin's only: nothing of the core's above it


EXPLODING_PLUGIN = """
from core_rl.hookspecs import hookimpl

def make_reward(config):
    raise ValueError("scores.bin is missing from the reward's data directory")

@hookimpl
def core_rl_register_rewards(register):
    register("exploding", make_reward, description="a reward whose factory raises")
"""


def test_an_engine_written_for_an_earlier_interface_is_refused_for_a_missing_keyword(contract_host) -> None:
    """A train engine whose save_state predates ``optimizer=`` (interface version 7) would fail at
    its first checkpoint, after training: it is refused when built, naming the keyword."""
    from core_rl.interfaces import TrainEngine
    from core_rl.plugins.components import check_contract
    from core_rl.plugins.kinds import TRAIN_ENGINE

    class OldEngine(TrainEngine):  # every abstract member, save_state and load_state of version 6
        def save_state(self, path, extra):
            pass

        def load_state(self, path, **anything):  # **kwargs takes optimizer=
            return {}

    for name in [m for m in TrainEngine.__abstractmethods__ if m not in ("save_state", "load_state")]:
        setattr(OldEngine, name, lambda self, *a, **k: None)
    OldEngine.__abstractmethods__ = frozenset()
    entry = attrs.evolve(contract_host.registries[REWARD.key].get("faulty"), kind=TRAIN_ENGINE)
    with pytest.raises(PluginFault) as info:
        check_contract(entry, OldEngine())
    assert "OldEngine.save_state takes no keyword argument 'optimizer', which core_rl.interfaces.TrainEngine." in str(
        info.value
    ) and "since interface version 7" in str(info.value)
    assert interface_version("PolicyLoss", "observe_step") == 7
