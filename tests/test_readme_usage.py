"""The commands of docs/runs.md ("The commands, in order", which the README's "Using it" section
held before it moved to the docs) run in the order written after the main job: each configuration
they name validates, each training run gets a run directory of its own (a second run into the main
job's would stop with "already holds a run"), and each run directory or model they read is one the
main job or an earlier command of the block writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from core_rl.config import load_config
from core_rl.plugins.host import PluginHost

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "runs.md").read_text()
MAIN_CONFIG = ROOT / "examples" / "tiny_grpo" / "grpo.yaml"  # main.py trains it as it is


def _usage_commands() -> list[list[str]]:
    """The ``core-rl`` commands of the first bash block under "## The commands, in order", as argument lists."""
    section = PAGE.split("\n## The commands, in order\n", 1)[1]
    block = re.search(r"^```bash\n(.*?)^```", section, flags=re.M | re.S)
    assert block is not None
    return [shlex.split(line, comments=True)[1:] for line in block.group(1).splitlines() if line.startswith("core-rl ")]


def _config_and_overrides(args: list[str]) -> tuple[Path, list[str]]:
    positional = [a for a in args[1:] if not a.startswith("--") and not a.isdigit()]
    if args[0] == "config":
        positional = positional[1:]  # the action
    return ROOT / positional[0], positional[1:]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost()


def test_the_usage_block_runs_after_the_main_job_as_written(host):
    commands = _usage_commands()
    assert {c[0] for c in commands} >= {"train", "eval", "config", "plot", "checkpoints"}
    main = load_config(MAIN_CONFIG, [], host=host).experiment.run_dir
    written = {(ROOT / main).resolve()}  # run directories that exist when the command runs
    for args in commands:
        if args[0] in ("train", "eval", "config"):
            config, overrides = _config_and_overrides(args)
            cfg = load_config(config, overrides, host=host, notify=lambda _: None)
            run_dir = (ROOT / cfg.experiment.run_dir).resolve()
            if args[0] == "train":
                assert run_dir not in written, f"{shlex.join(args)}: {run_dir} already holds a run"
                written.add(run_dir)
            if args[0] == "eval":
                model = (ROOT / cfg.actor.model_path).resolve()
                assert model.parent in written and model.name == "final_hf", shlex.join(args)
        elif args[0] in ("plot", "checkpoints"):
            named = [(ROOT / a).resolve() for a in args[1:] if not a.startswith("-")]
            assert named and all(path in written for path in named), shlex.join(args)
