"""Zero-signal updates (core_rl.loops.rl.update): an optimiser step whose loss cannot have a gradient
(``PolicyLoss.has_gradient`` is False, e.g. GRPO's ``ppo_clip`` with every advantage 0) skips its
forward and backward passes and still takes the optimiser step a zero gradient gives, bitwise, with
the real fsdp engine and AdamW; the steps are counted in metrics and the run's total survives a
resume of ``core-rl train``."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from core_rl.builtin.loggers import read_metrics
from core_rl.config.loader import structure
from core_rl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    OptimizerConfig,
    PluginSpec,
    SchedulerConfig,
    TeacherConfig,
)
from core_rl.errors import PluginFault
from core_rl.interfaces import LossOutput, PolicyLoss
from core_rl.loops.errors import RunFailed
from core_rl.loops.rl.distill import DistillationLoss
from core_rl.loops.rl.ptx import PTXLoss
from core_rl.loops.rl.update import PolicyUpdate, no_signal_warning, zero_gradient_rows
from core_rl.ops import aggregation_weights
from core_rl.plugins.guards import GuardedLoss
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import TRAIN_ENGINE
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl.testing.launch import run_train, write_grpo_config
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_grpo")

from core_rl_grpo.losses import PPOClipLoss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("zero_signal") / "model", seed=0)


def adamw_engine(model_path: Path):
    """The fsdp engine with AdamW (weight decay on) and a schedule whose learning rate changes every step."""
    host = PluginHost()
    entry = host.get(TRAIN_ENGINE, "fsdp")
    actor = ActorConfig(
        model_path=str(model_path),
        engine=PluginSpec(name="fsdp"),
        optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1),
        lr_scheduler=SchedulerConfig(name="cosine", warmup_steps=2, total_steps=40),
    )
    return entry.factory(actor, structure({}, entry.config_cls), trainable=True)


def policy_update(engine, loss: PolicyLoss, **algorithm: object) -> PolicyUpdate:
    return PolicyUpdate(
        engine=engine,
        ref=None,
        loss=loss,
        algorithm=AlgorithmConfig(**algorithm),
        temperature=1.0,
        shard=lambda b: b.rows(slice(0, None, 1)),
        world_size=1,
    )


class EveryStepRuns(PPOClipLoss):
    """``ppo_clip`` whose every step runs its forward and backward passes (the update without skipping)."""

    def has_gradient(self, batch: TensorBatch) -> bool:
        return True


def zero_advantage_batch(seed: int) -> TensorBatch:
    batch = make_rl_batch(batch_size=6, seed=seed)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    return batch


def plain(t: torch.Tensor) -> torch.Tensor:
    """A (possibly sharded) tensor as one local tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def optimizer_state(engine) -> list[dict[str, torch.Tensor]]:
    """AdamW's state of each parameter, in parameter order."""
    return [
        {k: plain(v).clone() for k, v in engine.optimizer.state[p].items()}
        for group in engine.optimizer.param_groups
        for p in group["params"]
    ]


def assert_bitwise_equal(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), i
        for key in a:
            assert torch.equal(a[key], b[key]), (i, key)


def test_a_skipped_update_is_bitwise_an_update_of_zero(model_path: Path) -> None:
    """Two engines trained alike (3 real updates, so AdamW's moments are nonzero), then the same
    all-zero-advantage batch: one runs every step's forward and backward, the other skips them.
    Weights, AdamW's moments and step counts, the engine's step and the learning rates are bitwise
    the same, and they moved (momentum and weight decay): the skipped update is no no-op."""
    full_engine, skip_engine = adamw_engine(model_path), adamw_engine(model_path)
    algorithm = {"ppo_n_minibatches": 2, "ppo_epochs": 2}
    full = policy_update(full_engine, EveryStepRuns(), **algorithm)
    skip = policy_update(skip_engine, PPOClipLoss(), **algorithm)
    for version in (1, 2, 3):
        for update in (full, skip):
            metrics = update(make_rl_batch(batch_size=6, seed=version), train_version=version)
            assert metrics["actor/zero_signal_steps"] == 0.0 and metrics["actor/zero_signal_update"] == 0.0
    weights_before = skip_engine.full_state_dict()
    moments_before = optimizer_state(skip_engine)
    assert_bitwise_equal([full_engine.full_state_dict()], [weights_before])  # the engines agree so far

    m_full = full(zero_advantage_batch(9), train_version=4)
    m_skip = skip(zero_advantage_batch(9), train_version=4)

    assert full_engine.step == skip_engine.step == 16
    assert_bitwise_equal([skip_engine.full_state_dict()], [full_engine.full_state_dict()])
    assert_bitwise_equal(optimizer_state(skip_engine), optimizer_state(full_engine))
    for key in ("actor/lr", "actor/loss", "actor/grad_norm", "actor/optimizer_steps", "actor/nonfinite"):
        assert m_skip[key] == m_full[key], key
    assert m_skip["actor/loss"] == 0.0 and m_skip["actor/grad_norm"] == 0.0
    assert (m_skip["actor/zero_signal_steps"], m_skip["actor/zero_signal_update"]) == (4.0, 1.0)
    assert (m_full["actor/zero_signal_steps"], m_full["actor/zero_signal_update"]) == (0.0, 0.0)
    assert m_skip["actor/zero_signal_updates_total"] == 1.0
    assert "actor/entropy" in m_full and "actor/entropy" not in m_skip  # of rows the skipped steps never saw
    # an update of zero moves the weights and decays the moments
    after = skip_engine.full_state_dict()
    assert any(not torch.equal(after[k], weights_before[k]) for k in after)
    steps = [int(s["step"]) for s in optimizer_state(skip_engine)]
    assert steps == [s + 4 for s in (int(s["step"]) for s in moments_before)]
    full_engine.close()
    skip_engine.close()


class CountingLoss(PolicyLoss):
    """``-A * logprob``, with a gradient exactly where some advantage of the step is nonzero; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.observed = 0

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return aggregation_weights(response_mask, "token-mean")

    def has_gradient(self, batch: TensorBatch) -> bool:
        return bool((batch["advantages"] != 0).any())

    def observe_step(self, metrics) -> dict[str, float]:
        self.observed += 1
        return {}

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        self.calls += 1
        return LossOutput(per_token_loss=-batch["advantages"] * logprobs)


def test_steps_are_skipped_one_by_one_and_counted(model_path: Path) -> None:
    """Of 3 minibatches x 2 epochs, the first minibatch's advantages are all 0: its 2 steps are
    skipped (the loss neither computes nor observes them), the other 4 run; the update is not
    zero-signal as a whole. The run's total counts whole updates only."""
    engine = adamw_engine(model_path)
    loss = CountingLoss()
    update = policy_update(engine, loss, ppo_n_minibatches=3, ppo_epochs=2)
    batch = make_rl_batch(batch_size=6, seed=1)
    batch["advantages"][:2] = 0.0
    metrics = update(batch, train_version=1)
    assert engine.step == 6 and (loss.calls, loss.observed) == (4, 4)
    assert metrics["actor/optimizer_steps"] == 6.0 and metrics["actor/zero_signal_steps"] == 2.0
    assert (metrics["actor/zero_signal_update"], metrics["actor/zero_signal_updates_total"]) == (0.0, 0.0)
    for version in (2, 3):
        metrics = update(zero_advantage_batch(version), train_version=version)
        assert (metrics["actor/zero_signal_update"], metrics["actor/zero_signal_updates_total"]) == (1.0, version - 1)
    assert engine.step == 18 and loss.calls == 4
    metrics = update(make_rl_batch(batch_size=6, seed=4), train_version=4)
    assert (metrics["actor/zero_signal_update"], metrics["actor/zero_signal_updates_total"]) == (0.0, 2.0)
    assert update.zero_signal.state_dict() == {"total": 2, "streak": 0}
    engine.close()


def test_no_step_is_skipped_where_it_could_change_the_update(model_path: Path) -> None:
    """With ``early_stop_kl`` (each step's measured KL decides the next) every step runs; so does
    every step of a loss that does not say (``has_gradient``'s default)."""
    engine = adamw_engine(model_path)
    loss = CountingLoss()
    update = policy_update(engine, GuardedLoss(loss, "policy loss 'counting'"), early_stop_kl=10.0)
    with pytest.raises(RunFailed, match="approx_kl"):  # every step ran: the first one reported no KL
        update(zero_advantage_batch(1), train_version=1)
    assert loss.calls == 1

    class Silent(CountingLoss):
        has_gradient = PolicyLoss.has_gradient

    silent = Silent()
    metrics = policy_update(engine, silent)(zero_advantage_batch(2), train_version=2)
    assert silent.calls == 1 and metrics["actor/zero_signal_steps"] == 0.0
    engine.close()


def test_wrapped_and_guarded_losses_decide(model_path: Path) -> None:
    """A wrapping loss adds a term with a gradient of its own (ptx rows, a teacher): every step runs
    whatever the base says; a teacher's term weighted 0 leaves the base's answer (weighted 0 too:
    none). The guard passes the base's answer on and refuses one that is no bool."""
    batch = zero_advantage_batch(1)
    base = CountingLoss()
    assert base.has_gradient(batch) is False
    assert PTXLoss(base).has_gradient(batch) is True
    teacher = TeacherConfig(model_path=str(model_path))
    assert DistillationLoss(base, teacher).has_gradient(batch) is True
    assert DistillationLoss(base, attrs.evolve(teacher, distill_coef=0.0)).has_gradient(batch) is False
    assert DistillationLoss(base, attrs.evolve(teacher, distill_coef=0.0)).has_gradient(make_rl_batch()) is True
    assert (
        DistillationLoss(base, attrs.evolve(teacher, distill_coef=0.0, rl_coef=0.0)).has_gradient(make_rl_batch())
        is False
    )
    assert GuardedLoss(base, "policy loss 'counting'").has_gradient(batch) is False

    class TensorAnswer(CountingLoss):
        def has_gradient(self, batch: TensorBatch) -> bool:
            return (batch["advantages"] != 0).any()  # type: ignore[return-value]

    with pytest.raises(PluginFault, match="has_gradient; PolicyLoss.has_gradient returns a bool"):
        GuardedLoss(TensorAnswer(), "policy loss 'counting'").has_gradient(batch)


def test_the_zero_gradient_row_reaches_every_parameter(model_path: Path) -> None:
    """The row the skipped step trains on gives every trainable parameter a gradient tensor (an
    optimiser skips a parameter without one), all of it 0."""
    from core_rl.loops.rl.update import ZeroLoss

    engine = adamw_engine(model_path)
    grads: dict[str, torch.Tensor] = {}
    apply = engine._apply_update

    def record(loss: float) -> float:
        for name, p in engine.model.named_parameters():
            if p.requires_grad:
                grads[name] = None if p.grad is None else plain(p.grad).clone()
        return apply(loss)

    engine._apply_update = record
    metrics = engine.train_step(zero_gradient_rows(0), ZeroLoss())
    assert grads and all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in grads.values())
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    engine.close()


REWARD = '''
import itertools

_distinct = itertools.count()


def score(row):
    """1 for every answer to a "uniform" prompt; otherwise a number no other answer gets."""
    return 1.0 if row["uniform"] else float(next(_distinct))
'''


@pytest.fixture(scope="module")
def uniform_first(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """A GRPO run on 4 prompts, 2 a step, in file order: step 1's groups each score alike (every
    advantage 0), step 2's do not; a checkpoint after every step."""
    root = tmp_path_factory.mktemp("uniform_first")
    (root / "reward.py").write_text(REWARD)
    rows = [{"prompt": p, "uniform": u} for p, u in (("ab=", True), ("ba=", True), ("abc=", False), ("cd=", False))]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_grpo_config(
        root,
        model_path,
        [str(root / "train.jsonl")],
        data={"train_files": [str(root / "train.jsonl")], "batch_size": 2, "shuffle": False},
        reward={"name": "function", "path": f"{root / 'reward.py'}:score"},
        trainer={"total_steps": 2, "torch_threads": 1},
        saver={"every_n_steps": 1, "export_hf": False},
    )


def check_steps(metrics: dict[int, dict[str, float]]) -> None:
    """Step 1 is a zero-signal update (gradient norm 0), step 2 is not; the run's total is 1 at both."""
    first, second = metrics[1], metrics[2]
    assert first["reward/mean"] == 1.0 and second["reward/mean"] != 1.0
    assert (first["actor/zero_signal_update"], first["actor/zero_signal_steps"]) == (1.0, 1.0)
    assert first["actor/zero_signal_updates_total"] == 1.0 and first["actor/grad_norm"] == 0.0
    assert (second["actor/zero_signal_update"], second["actor/zero_signal_steps"]) == (0.0, 0.0)
    assert second["actor/zero_signal_updates_total"] == 1.0 and second["actor/grad_norm"] > 0.0


def test_core_rl_train_counts_zero_signal_updates_and_resumes_the_total(uniform_first: Path) -> None:
    """The run stops after step 1 with a checkpoint; the resumed run's step 2 has the total it restored."""
    run_train(uniform_first, "experiment.name=resumed", "trainer.total_steps=1")
    run_train(uniform_first, "experiment.name=resumed", "recover.mode=auto")
    metrics = {r["step"]: r for r in read_metrics(uniform_first.parent / "runs" / "resumed" / "metrics.jsonl")}
    assert sorted(metrics) == [1, 2]
    check_steps(metrics)


def test_two_ranks_take_the_zero_gradient_step_together(uniform_first: Path) -> None:
    """On 2 ranks every rank skips step 1 alike (its zero-gradient step is a collective of the engine)."""
    run_train(uniform_first, "experiment.name=two_ranks", nproc=2, cpu=True)
    metrics = {r["step"]: r for r in read_metrics(uniform_first.parent / "runs" / "two_ranks" / "metrics.jsonl")}
    assert sorted(metrics) == [1, 2]
    check_steps(metrics)


def test_updates_without_signal_in_a_row_are_warned_once_with_their_cause(uniform_first: Path) -> None:
    """``trainer.warn_no_signal_steps: 1``: step 1 (every group scored alike, every response cut at
    ``max_new_tokens``) is one warning naming both; step 2 has a signal and says nothing. The default
    (3) says nothing of one such step."""
    proc = run_train(
        uniform_first,
        "experiment.name=warned",
        "trainer.warn_no_signal_steps=1",
        "rollout.sampling.min_new_tokens=4",  # every response runs to max_new_tokens (4)
    )
    assert proc.stderr.count("no learning signal") == 1, proc.stderr
    assert (
        "core-rl: warning: step 1: no learning signal: every sample of step 1 scored 1, so every advantage was 0; "
        "100% of its responses were cut at rollout.sampling.max_new_tokens (4): raise it so that answers can end "
        "(trainer.warn_no_signal_steps: 1; 0 turns this off)\n"
    ) in proc.stderr
    quiet = run_train(uniform_first, "experiment.name=quiet", "trainer.total_steps=1")
    assert "no learning signal" not in quiet.stderr


def test_the_no_signal_warning_names_what_the_step_shows() -> None:
    """Once per streak, at its ``after``-th update; what it names follows the step's metrics."""
    uniform = {"reward/min": 0.0, "reward/max": 0.0, "response_length/clip_fraction": 0.25}
    assert no_signal_warning(5, 3, uniform, after=3, max_new_tokens=8) == (
        "steps 3-5: no learning signal: every sample of step 5 scored 0, so every advantage was 0; check on a few "
        "scored samples (sample_log) that the reward reads the answers as intended; for a task too hard or too easy "
        "for the model, raise rollout.sampling.n or choose prompts of its level (trainer.warn_no_signal_steps: 3; "
        "0 turns this off)"
    )
    assert [no_signal_warning(5, streak, uniform, after=3, max_new_tokens=8) for streak in (0, 2, 4)] == [None] * 3
    assert no_signal_warning(5, 0, uniform, after=0, max_new_tokens=8) is None
    spread = {"reward/min": 0.0, "reward/max": 1.0, "response_length/clip_fraction": 0.5}
    line = no_signal_warning(7, 2, spread, after=2, max_new_tokens=16)
    assert line is not None and line.startswith(
        "steps 6-7: no learning signal: in each group of step 7 the samples scored alike, so every advantage was 0; "
        "50% of its responses were cut at rollout.sampling.max_new_tokens (16)"
    )
