"""Registering the plugin is cheap: ``plugin.py`` imports no torch, so ``core-rl plugins`` and
``core-rl config validate`` do not pay for it (torch is imported when a run builds the estimator)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import core_rl_example_plugin

REGISTER_AND_REPORT = """
import sys
from core_rl.plugins.kinds import ADVANTAGE, REWARD
from core_rl.plugins.host import PluginHost
import core_rl_example_plugin.plugin as plugin

host = PluginHost(entry_points=[])
host.register_plugin(plugin, distribution="core-rl-example-plugin")
assert host.get(ADVANTAGE, "rank_advantage").config_cls is not None
assert host.get(REWARD, "keyword_reward").config_cls is not None
print("torch imported:", "torch" in sys.modules)
"""


def test_registration_imports_no_torch() -> None:
    # a fresh interpreter: this test process has imported torch already
    package_root = Path(core_rl_example_plugin.__file__).resolve().parents[1]
    pythonpath = os.pathsep.join(p for p in (str(package_root), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", REGISTER_AND_REPORT],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch imported: False"


def test_the_factory_builds_the_estimator_on_demand() -> None:
    from core_rl_example_plugin.advantage import RankAdvantage
    from core_rl_example_plugin.config import RankAdvantageConfig
    from core_rl_example_plugin.plugin import make_rank_advantage

    estimator = make_rank_advantage(RankAdvantageConfig(scale=3.0))
    assert isinstance(estimator, RankAdvantage)
    assert estimator.config.scale == 3.0
