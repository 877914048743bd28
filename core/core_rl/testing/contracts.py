"""Contract test classes of the plugin kinds other than engines (those: :mod:`core_rl.testing.engine_contracts`
and :mod:`core_rl.testing.rollout_contracts`).

Each contract registers ``plugin`` in a fresh :class:`~core_rl.plugins.host.PluginHost` (no entry points),
builds the component named ``name`` with ``options`` validated by its ``config_cls``, and checks the
behaviour every component of that kind must have. Tests that need a model build a tiny one offline.
"""

from __future__ import annotations

import importlib.metadata as md
import math
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

from core_rl.config.checks import (
    EnvironmentContext,
    MachineInfo,
    config_problems,
    data_problems,
    environment_problems,
    required_columns,
)
from core_rl.config.converter import structure
from core_rl.config.loader import merge_raw
from core_rl.config.schema import (
    AlgorithmConfig,
    PluginSpec,
    RunConfig,
)
from core_rl.config.sections import validate_plugin_section
from core_rl.errors import ConfigError, DataError
from core_rl.interfaces import (
    AdvantageEstimator,
    AlgorithmRecipe,
    ImportanceCorrection,
    Logger,
    PolicyLoss,
    RejectionSampler,
    Reward,
    RunInfo,
    SampleFilter,
    SampleRecord,
)
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import (
    ADVANTAGE,
    ALGORITHM,
    LOGGER,
    LOOP,
    POLICY_LOSS,
    REJECTION_SAMPLER,
    REWARD,
    SAMPLE_FILTER,
    WORKFLOW,
    PluginKind,
)
from core_rl.plugins.registry import RegistryEntry
from core_rl.protocol import RewardInput, TensorBatch
from core_rl.testing.helpers import (  # noqa: F401  (re-exported: plugins' tests import them from here)
    hf_logprobs,
    installed_distribution,
    make_grouped_rl_batch,
    make_reward_input,
    make_rl_batch,
    recipe_host,
)

# ---------------------------------------------------------------------------------------------
# base


class ComponentContract:
    """What every registered component must satisfy.

    Set ``plugin`` (the object with the hook implementations), ``name`` (the registered name),
    optionally ``options`` (its YAML section without ``name``) and ``distribution`` (the installed
    distribution that must declare the entry point).
    """

    kind: ClassVar[PluginKind]
    plugin: ClassVar[object]
    name: ClassVar[str]
    options: ClassVar[dict[str, Any]] = {}
    distribution: ClassVar[str | None] = None
    #: other plugins the component's nested sections select (e.g. the parts of a combined reward)
    extra_plugins: ClassVar[list[object]] = []

    def host(self) -> PluginHost:
        host = PluginHost(entry_points=[])
        host.register_plugin(self.plugin, distribution=self.distribution or "<test>")
        for extra in self.extra_plugins:
            host.register_plugin(extra, distribution="<test extra>")
        return host

    def entry(self) -> RegistryEntry:
        return self.host().get(self.kind, self.name)

    def config(self, **overrides: Any) -> Any:
        """The validated config (nested plugin sections resolved), ``None`` without a config class."""
        spec = PluginSpec(name=self.name, options={**self.options, **overrides})
        validate_plugin_section(self.host(), self.kind, spec, self.kind.key)
        return spec.config

    def test_registered_with_description(self) -> None:
        entry = self.entry()
        assert entry.name == self.name
        assert entry.description, f"{self.kind.label} {self.name!r} needs a one-line description"

    def test_entry_point_declared(self) -> None:
        if self.distribution is None:
            pytest.skip("no distribution named: the entry point is not checked")
        eps = [ep for ep in md.distribution(self.distribution).entry_points if ep.group == self.kind.group]
        names = [ep.name for ep in eps]
        assert self.name in names, f"{self.distribution} declares no {self.kind.group} entry point {self.name!r}"
        loaded = next(ep for ep in eps if ep.name == self.name).load()
        assert loaded is self.plugin

    def test_optional_checks_return_problem_lines(self) -> None:
        """``check_config``, ``check_environment``, ``check_data`` and ``required_columns``, where the
        config class defines them, return lists of strings (see :mod:`core_rl.config.checks`) for
        the configured options, a default run, a machine without a GPU and no data rows."""
        config = self.config()
        if config is None:
            pytest.skip("takes no options")
        context = EnvironmentContext(path=self.kind.key, run=RunConfig(), name=self.name, machine=MachineInfo())
        checks = (config_problems(config, context), environment_problems(config, context))
        for problems in (*checks, data_problems(config, [], context)):
            assert all(isinstance(p, str) and p for p in problems)
        assert all(isinstance(c, str) and c for c in required_columns(config))

    def test_unknown_option_is_rejected(self) -> None:
        entry = self.entry()
        if entry.config_cls is None:
            pytest.skip("takes no options")
        with pytest.raises(ConfigError, match="no_such_option"):
            structure({**self.options, "no_such_option": 1}, entry.config_cls, path=self.kind.key)


# ---------------------------------------------------------------------------------------------
# algorithm-side kinds


class AdvantageEstimatorContract(ComponentContract):
    """An advantage estimator returns finite [B, T] advantages that vanish off the response."""

    kind = ADVANTAGE

    def make(self) -> AdvantageEstimator:
        est = self.entry().factory(self.config())
        assert isinstance(est, AdvantageEstimator)
        return est

    @staticmethod
    def batch(seed: int = 0) -> TensorBatch:
        """:func:`make_rl_batch` plus ``values`` (random, on the response), for estimators that
        declare ``requires_values``."""
        batch = make_rl_batch(seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        batch["values"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
        return batch

    def test_shape_and_mask(self) -> None:
        batch = self.batch()
        adv = self.make()(batch)
        assert adv.shape == batch["response_mask"].shape
        assert torch.isfinite(adv).all()
        assert (adv[batch["response_mask"] == 0] == 0).all()

    def test_deterministic(self) -> None:
        batch = self.batch(seed=3)
        assert torch.equal(self.make()(batch), self.make()(batch))


class PolicyLossContract(ComponentContract):
    """A policy loss gives a finite per-token loss whose weighted sum does not depend on how the
    batch is split, and whose gradient vanishes off the response."""

    kind = POLICY_LOSS

    def make(self) -> PolicyLoss:
        loss = self.entry().factory(self.config())
        assert isinstance(loss, PolicyLoss)
        return loss

    def _batch(self, loss: PolicyLoss, seed: int = 0) -> TensorBatch:
        batch = make_rl_batch(seed=seed)
        batch["loss_weight"] = loss.loss_weights(batch["response_mask"])
        return batch

    def _logprobs(self, batch: TensorBatch) -> torch.Tensor:
        noise = torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(7)) * 0.3
        return ((batch["old_logprobs"] + noise) * batch["response_mask"]).requires_grad_(True)

    def test_shape_and_finite(self) -> None:
        loss = self.make()
        batch = self._batch(loss)
        lp = self._logprobs(batch)
        out = loss(batch, lp, torch.ones_like(lp))
        assert out.per_token_loss.shape == lp.shape
        assert torch.isfinite(out.per_token_loss).all()
        for key, value in out.token_metrics.items():
            assert value.shape == lp.shape, f"token metric {key!r} must be [b, T]"

    def test_split_invariance(self) -> None:
        loss = self.make()
        batch = self._batch(loss, seed=1)
        lp = self._logprobs(batch)
        ent = torch.ones_like(lp)
        full = (loss(batch, lp, ent).per_token_loss * batch["loss_weight"]).sum()
        parts = []
        for rows in (slice(0, 2), slice(2, 3), slice(3, None)):
            mb = batch.rows(rows)
            parts.append((loss(mb, lp[rows], ent[rows]).per_token_loss * mb["loss_weight"]).sum())
        torch.testing.assert_close(full, torch.stack(parts).sum())

    def test_gradient_only_on_response(self) -> None:
        loss = self.make()
        batch = self._batch(loss, seed=2)
        lp = self._logprobs(batch)
        (loss(batch, lp, torch.ones_like(lp)).per_token_loss * batch["loss_weight"]).sum().backward()
        assert lp.grad is not None
        assert (lp.grad[batch["response_mask"] == 0] == 0).all()
        assert lp.grad.abs().sum() > 0

    def test_no_gradient_where_it_says_none(self) -> None:
        """``has_gradient`` answers a bool; where it answers ``False`` (asked here with every
        advantage 0) the gradient with respect to the log-probs and the entropy is exactly 0: the
        update skips such a step's forward and backward passes (:meth:`PolicyLoss.has_gradient`)."""
        loss = self.make()
        batch = self._batch(loss, seed=3)
        batch["advantages"] = torch.zeros_like(batch["advantages"])
        loss.prepare(batch)
        batch["loss_weight"] = loss.loss_weights(batch["loss_mask"])
        answer = loss.has_gradient(batch)
        assert isinstance(answer, bool)
        if answer:  # every step runs: nothing promised
            return
        lp = self._logprobs(batch)
        ent = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        (loss(batch, lp, ent).per_token_loss * batch["loss_weight"]).sum().backward()
        for grad in (lp.grad, ent.grad):
            assert grad is None or torch.equal(grad, torch.zeros_like(grad))


class SampleFilterContract(ComponentContract):
    """A sample filter returns a bool [B] keep-mask and is deterministic."""

    kind = SAMPLE_FILTER

    def make(self) -> SampleFilter:
        f = self.entry().factory(self.config())
        assert isinstance(f, SampleFilter)
        return f

    def test_returns_bool_mask(self) -> None:
        batch = make_rl_batch()
        keep = self.make()(batch)
        assert keep.dtype == torch.bool and keep.shape == (batch.batch_size,)

    def test_deterministic(self) -> None:
        batch = make_rl_batch(seed=5)
        assert torch.equal(self.make()(batch), self.make()(batch))

    def test_keeps_or_drops_whole_groups(self) -> None:
        """A filter decides per prompt group (see :mod:`core_rl.loops.rl.filtering`), here on a batch
        with a group of equal rewards beside groups of random ones."""
        from core_rl.loops.rl.filtering import check_mask

        batch = make_rl_batch(batch_size=12, group_size=3, seed=7)
        batch["rewards"][:3] = 0.5
        check_mask(f"sample filter {self.name!r}", self.make()(batch), batch["group_index"])


class RejectionSamplerContract(ComponentContract):
    """A rejection sampler returns [b, T] weights and a bool keep-mask that vanish off the response,
    decides each row from that row alone, is deterministic, and changes nothing when the proximal
    and behaviour policies agree (every weight 1, every token kept, for bounds that admit 1 and
    the metric's value at agreement)."""

    kind = REJECTION_SAMPLER

    def make(self, **overrides: Any) -> RejectionSampler:
        sampler = self.entry().factory(self.config(**overrides))
        assert isinstance(sampler, RejectionSampler)
        return sampler

    def _inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = make_rl_batch(seed=seed)
        return batch["old_logprobs"], batch["behave_logprobs"], batch["response_mask"]

    def test_shapes_and_off_response(self) -> None:
        prox, behave, mask = self._inputs()
        out = self.make()(prox, behave, mask)
        assert isinstance(out, ImportanceCorrection)
        assert out.weight.shape == mask.shape and out.keep.shape == mask.shape
        assert out.keep.dtype == torch.bool
        assert torch.isfinite(out.weight).all() and (out.weight >= 0).all()
        off = mask == 0
        assert (out.weight[off] == 0).all() and not out.keep[off].any()

    def test_row_local_and_deterministic(self) -> None:
        prox, behave, mask = self._inputs(seed=3)
        whole = self.make()(prox, behave, mask)
        again = self.make()(prox, behave, mask)
        assert torch.equal(whole.weight, again.weight) and torch.equal(whole.keep, again.keep)
        for rows in (slice(0, 2), slice(2, None)):
            part = self.make()(prox[rows], behave[rows], mask[rows])
            torch.testing.assert_close(part.weight, whole.weight[rows])
            assert torch.equal(part.keep, whole.keep[rows])

    def test_agreeing_policies_change_nothing(self) -> None:
        _, behave, mask = self._inputs(seed=4)
        out = self.make()(behave.clone(), behave, mask)
        on = mask != 0
        torch.testing.assert_close(out.weight, mask)
        assert torch.equal(out.keep, on)


class RewardContract(ComponentContract):
    """A reward returns one float per input, in order; ``examples`` pins (input, expected score)."""

    kind = REWARD
    examples: ClassVar[list[tuple[RewardInput, float]]] = []
    #: columns the reward reads that valid rows may hold null in, so it cannot declare them (the
    #: run's check requires a declared column in every row, not null); the contract keeps them
    nullable_columns: ClassVar[tuple[str, ...]] = ()

    def make(self) -> Reward:
        r = self.entry().factory(self.config())
        assert isinstance(r, Reward)
        return r

    def test_examples(self) -> None:
        assert self.examples, "set `examples` to (RewardInput, expected score) pairs"
        scores = self.make().score([inp for inp, _ in self.examples])
        assert len(scores) == len(self.examples)
        for (inp, expected), got in zip(self.examples, scores):
            assert isinstance(got, float)
            assert math.isclose(got, expected, abs_tol=1e-6), f"{inp.response_text!r}: expected {expected}, got {got}"

    def test_empty_input(self) -> None:
        assert self.make().score([]) == []

    def test_needs_only_the_row_columns_it_declares(self) -> None:
        """A data-row column the reward cannot score without is one its config declares
        (``required_columns()``), so that the run checks every training and eval row for it before
        any model loads: each example scores without each undeclared column of its row, or at least
        does not fail for want of it (``DataError`` or ``KeyError``); :attr:`nullable_columns` stay."""
        config = self.config()
        declared = set(required_columns(config)) | set(self.nullable_columns)
        reward = self.make()
        try:
            for item, _ in self.examples:
                for column in [c for c in item.row if c not in declared]:
                    without = {k: v for k, v in item.row.items() if k != column}
                    try:
                        reward.score([attrs.evolve(item, row=without)])
                    except (DataError, KeyError) as exc:
                        pytest.fail(
                            f"{self.name!r} fails on a row without {column!r} ({type(exc).__name__}: {exc}), but "
                            f"{type(config).__qualname__}.required_columns() does not name it (declared: "
                            f"{sorted(declared)}); declare it so that the run checks the data before it starts"
                        )
        finally:
            reward.close()

    def test_score_with_parts_agrees_with_score(self) -> None:
        reward = self.make()
        items = [inp for inp, _ in self.examples]
        result = reward.score_with_parts(items)
        assert result.scores == pytest.approx(reward.score(items), abs=1e-6, nan_ok=True)
        for name, values in result.parts.items():
            assert len(values) == len(items), f"part {name!r} has {len(values)} values for {len(items)} items"
        reward.close()
        reward.close()


class LoggerContract(ComponentContract):
    """A logger survives start / log (including non-finite values) / close, and close twice."""

    kind = LOGGER

    def make(self) -> Logger:
        lg = self.entry().factory(self.config())
        assert isinstance(lg, Logger)
        return lg

    def run_info(self, tmp_path: Path) -> RunInfo:
        return RunInfo(name="contract", output_dir=tmp_path / "run", config={"trainer": {"total_steps": 2}})

    def test_lifecycle(self, tmp_path: Path) -> None:
        lg = self.make()
        lg.start(self.run_info(tmp_path))
        lg.log({"reward/mean": 0.5, "actor/loss": 1.25}, step=1)
        lg.log({"reward/mean": float("nan"), "actor/grad_norm": float("inf")}, step=2)
        lg.close()
        lg.close()

    def test_log_samples(self, tmp_path: Path) -> None:
        lg = self.make()
        lg.start(self.run_info(tmp_path))
        lg.log({"reward/mean": 0.5}, step=1)
        samples = [
            SampleRecord(prompt="abc=", response="cba", reward=1.0, finish_reason="stop", parts={"match": 1.0}),
            SampleRecord(prompt='quote " | pipe\n', response="", reward=float("nan"), finish_reason="length"),
            SampleRecord(
                prompt="p=", response="ab", reward=0.5, finish_reason="stop", info={"turns": 2, "answers": ["a", "b"]}
            ),
        ]
        lg.log_samples(samples, step=1)
        lg.log({"reward/mean": 0.75}, step=2)
        lg.log_samples(samples[:1], step=2)
        lg.close()


class AlgorithmContract(ComponentContract):
    """An algorithm's recipe defaults must yield a valid configuration with installed plugins."""

    kind = ALGORITHM

    def test_recipe(self) -> None:
        recipe = self.entry().factory()
        assert isinstance(recipe, AlgorithmRecipe)
        assert "algorithm" in recipe.defaults

    def test_defaults_validate(self) -> None:
        """The recipe's algorithm section, alone, validates against the installed plugins."""
        host = PluginHost()
        host.register_plugin(self.plugin, distribution=self.distribution or "<test>")
        data = merge_raw(None, [f"algorithm.name={self.name}"], host)
        algorithm = structure(data["algorithm"], AlgorithmConfig, path="algorithm")
        loop = data.get("trainer", {}).get("loop")
        if loop is not None:  # a recipe that selects its training loop
            spec = PluginSpec(name=loop["name"], options={k: v for k, v in loop.items() if k != "name"})
            validate_plugin_section(host, LOOP, spec, "trainer.loop")
            if not getattr(spec.config, "rl_sections", True):
                return  # a loop without rollouts needs no advantage estimator or policy loss
        assert algorithm.advantage is not None and algorithm.loss is not None
        validate_plugin_section(host, ADVANTAGE, algorithm.advantage, "algorithm.advantage")
        validate_plugin_section(host, POLICY_LOSS, algorithm.loss, "algorithm.loss")
        for i, spec in enumerate(algorithm.filters):
            validate_plugin_section(host, SAMPLE_FILTER, spec, f"algorithm.filters[{i}]")


class LoopContract(ComponentContract):
    """A training loop is registered with a factory taking ``(cfg, host, *, stop, data_rows,
    config)`` and, where it has options, a config class whose defaults validate and which says
    whether it uses the RL sections (``rl_sections``, a bool) and which role sections it reads
    (``roles``, names of :data:`core_rl.roles.build.OPTIONAL_ROLES`). Whether it trains, resumes exactly
    and stops on a signal is the plugin's own tests' business (they need a model and data)."""

    kind = LOOP

    def test_factory_signature(self) -> None:
        import inspect

        signature = inspect.signature(self.entry().factory)
        signature.bind(RunConfig(), PluginHost(entry_points=[]), stop=None, data_rows=None, config=self.config())

    def test_declares_rl_sections(self) -> None:
        config = self.config()
        assert isinstance(getattr(config, "rl_sections", True), bool)

    def test_declares_known_roles(self) -> None:
        from core_rl.roles.build import OPTIONAL_ROLES

        roles = getattr(self.config(), "roles", ())
        assert isinstance(roles, tuple) and set(roles) <= set(OPTIONAL_ROLES), roles


class WorkflowContract(ComponentContract):
    """A rollout workflow is registered with a factory taking its validated config (``None``
    without a config class) and returning a :class:`~core_rl.rollout.workflows.RolloutWorkflow` whose
    ``run`` is a coroutine function. What it generates through an engine is the plugin's own tests'
    business (they need a model)."""

    kind = WORKFLOW

    def test_factory_builds_a_workflow(self) -> None:
        import inspect

        from core_rl.rollout.workflows import RolloutWorkflow

        workflow = self.entry().factory(self.config())
        assert isinstance(workflow, RolloutWorkflow)
        assert inspect.iscoroutinefunction(workflow.run)
