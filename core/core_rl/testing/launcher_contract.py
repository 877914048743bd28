"""The contract of launchers (:class:`LauncherContract`): built from its section, it is a
:class:`~core_rl.launch.launchers.Launcher`, and its ``check`` judges a placement by the resources it is
given: nothing against a placement that fits, and lines naming the key for one that does not."""

from __future__ import annotations

from core_rl.config.placement import PlacementConfig, RolePlacement
from core_rl.config.schema import RunConfig
from core_rl.launch.launchers import Launcher
from core_rl.launch.placement import ClusterResources
from core_rl.plugins.kinds import LAUNCHER
from core_rl.testing.contracts import ComponentContract

#: resources every contract placement below fits in
ROOMY = ClusterResources(nodes=4, gpus_per_node=8, cpus_per_node=64, source="the contract's resources")


class LauncherContract(ComponentContract):
    """Set ``plugin``, ``name`` and ``options`` (the ``launcher:`` section without ``name``)."""

    kind = LAUNCHER

    def make(self) -> Launcher:
        launcher = self.entry().factory(self.config())
        assert isinstance(launcher, Launcher), f"launcher {self.name!r} must subclass core_rl.launch.launchers.Launcher"
        return launcher

    def run(self, **actor: int) -> RunConfig:
        return RunConfig(placement=PlacementConfig(actor=RolePlacement(**actor)))

    def test_a_placement_that_fits_has_no_problems(self) -> None:
        assert self.make().check(self.run(gpus=8, nodes=4), ROOMY) == []

    def test_a_placement_beyond_the_resources_names_the_key(self) -> None:
        problems = self.make().check(self.run(gpus=9, nodes=5), ROOMY)
        assert any(p.startswith("placement.actor.gpus: ") for p in problems), problems
        assert any(p.startswith("placement.actor.nodes: ") for p in problems), problems

    def test_check_without_resources_returns_problem_lines(self) -> None:
        problems = self.make().check(RunConfig(), None)
        assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)
