"""Training loops as a plugin kind: ``trainer.loop`` selects a ``core_rl.loops`` entry (default the
built-in ``rl``); a loop that says ``rl_sections = False`` needs no reward, advantage or policy loss;
``core-rl train``'s path (:func:`core_rl.loops.run.run_with_restarts`) builds whatever loop is
selected through its registered factory, with the run's signals and data rows."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import yaml
from core_rl.builtin.loops import make_rl_loop
from core_rl.config.loader import load_config
from core_rl.errors import ConfigError
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import TrainingLoop
from core_rl.loops.run import run_with_restarts
from core_rl.loops.signals import StopSignals
from core_rl.plugins.kinds import LOOP


@attrs.define
class CountConfig:
    rl_sections: ClassVar[bool] = False
    steps: int = 3


class CountingLoop(TrainingLoop):
    """Records what its factory received; ``run`` returns it."""

    def __init__(self, cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: CountConfig) -> None:
        self.received = {"cfg": cfg, "host": host, "stop": stop, "data_rows": data_rows, "config": config}
        self.closed = 0

    def run(self) -> dict[str, Any]:
        return {**self.received, "loop": self}

    def close(self) -> None:
        self.closed += 1


class LoopPlugin:
    @hookimpl
    def core_rl_register_loops(self, register: Register) -> None:
        register("count", CountingLoop, description="test loop", config_cls=CountConfig)


def write(tmp_path, data: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_rl_is_the_builtin_default_loop(tmp_path, host, minimal_config):
    cfg = load_config(write(tmp_path, minimal_config), [], host=host)
    assert cfg.trainer.loop.name == "rl" and cfg.trainer.loop.config is None
    entry = host.get(LOOP, "rl")
    assert entry.factory is make_rl_loop and entry.distribution == "core-rl"


def test_a_loop_without_rl_sections_needs_no_reward_or_policy_loss(tmp_path, host, minimal_config):
    host.register_plugin(LoopPlugin(), distribution="test-loops")
    data = {k: v for k, v in minimal_config.items() if k not in ("reward", "algorithm")}
    data["trainer"] = {"loop": {"name": "count", "steps": 5}}
    cfg = load_config(write(tmp_path, data), [], host=host)
    assert cfg.trainer.loop.config == CountConfig(steps=5)
    # the RL loop still requires them
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), ["trainer.loop.name=rl"], host=host)
    assert any(p.startswith("reward: required") for p in info.value.problems)
    # a bad option of the loop is the only problem reported (not the RL sections it does not use)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), ["trainer.loop.steps=x"], host=host)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("trainer.loop.steps:")


@attrs.define
class RefOnlyConfig:
    rl_sections: ClassVar[bool] = False
    roles: ClassVar[tuple[str, ...]] = ("ref",)


class RefOnlyPlugin:
    @hookimpl
    def core_rl_register_loops(self, register: Register) -> None:
        register("ref_only", CountingLoop, description="reads ref: only", config_cls=RefOnlyConfig)


def test_a_role_section_the_loop_does_not_read_is_refused(tmp_path, host, minimal_config):
    """A section the selected loop never reads would be ignored silently: one problem per section,
    naming the loop, its distribution and what it does read; the rl loop reads all of them."""
    host.register_plugin(LoopPlugin(), distribution="test-loops")
    host.register_plugin(RefOnlyPlugin(), distribution="test-ref-loops")
    data = {k: v for k, v in minimal_config.items() if k not in ("reward", "algorithm")}
    model = minimal_config["actor"]["model_path"]
    data["teacher"] = {"model_path": model}
    data["ref"] = {"model_path": model}
    data["trainer"] = {"loop": {"name": "count"}}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data), [], host=host)
    assert info.value.problems == [
        "ref: the 'count' loop (distribution test-loops) does not use a ref: section (it reads no role section); "
        "remove the section, or select a loop that uses it (trainer.loop.name: rl)",
        "teacher: the 'count' loop (distribution test-loops) does not use a teacher: section (it reads no role "
        "section); remove the section, or select a loop that uses it (trainer.loop.name: rl)",
    ]
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["trainer.loop.name=ref_only"], host=host)
    line = (tmp_path / "run.yaml").read_text().splitlines().index("teacher:") + 1
    assert info.value.problems == [
        "teacher: the 'ref_only' loop (distribution test-ref-loops) does not use a teacher: section (it reads "
        "ref:); remove the section, or select a loop that uses it (trainer.loop.name: rl) (values: teacher in "
        f"{path}:{line}; trainer.loop.name=ref_only on the command line (trainer.loop.name=ref_only))"
    ]
    cfg = load_config(write(tmp_path, {**minimal_config, "teacher": {"model_path": model}}), [], host=host)
    assert cfg.teacher is not None and cfg.trainer.loop.name == "rl"


def test_an_unknown_loop_lists_the_installed_ones(tmp_path, host, minimal_config):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, minimal_config), ["trainer.loop.name=nope"], host=host)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("trainer.loop.name: training loop 'nope' is not installed (installed: ")


def test_training_builds_the_selected_loop_through_its_factory(tmp_path, host, minimal_config):
    host.register_plugin(LoopPlugin(), distribution="test-loops")
    data = {**minimal_config, "trainer": {"loop": {"name": "count", "steps": 2}}}
    cfg = load_config(write(tmp_path, data), [], host=host)
    rows = ["row"]
    result = run_with_restarts(cfg, host, data_rows=rows)  # type: ignore[arg-type]
    assert result["cfg"] is cfg and result["host"] is host and result["data_rows"] is rows
    assert isinstance(result["stop"], StopSignals) and result["config"] == CountConfig(steps=2)
    assert result["loop"].closed == 1
