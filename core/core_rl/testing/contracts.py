"""Contract test classes, one per plugin kind. See :mod:`core_rl.testing` for how to use them.

Each contract registers ``plugin`` in a fresh :class:`~core_rl.plugins.PluginHost` (no entry points),
builds the component named ``name`` with ``options`` validated by its ``config_cls``, and checks the
behaviour every component of that kind must have. Tests that need a model build a tiny one offline.
"""

from __future__ import annotations

import importlib.metadata as md
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from core_rl.config.loader import merge_raw, structure, validate_plugin_section
from core_rl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    MicroBatchConfig,
    OptimizerConfig,
    PluginSpec,
    RolloutConfig,
)
from core_rl.errors import ConfigError
from core_rl.interfaces import (
    AdvantageEstimator,
    AlgorithmRecipe,
    Logger,
    LossOutput,
    PolicyLoss,
    Reward,
    RolloutEngine,
    RunInfo,
    SampleFilter,
    SamplingParams,
    TrainEngine,
)
from core_rl.kinds import (
    ADVANTAGE,
    ALGORITHM,
    LOGGER,
    POLICY_LOSS,
    REWARD,
    ROLLOUT_ENGINE,
    SAMPLE_FILTER,
    TRAIN_ENGINE,
    PluginKind,
)
from core_rl.ops import aggregation_weights
from core_rl.plugins import PluginHost
from core_rl.protocol import RewardInput, TensorBatch
from core_rl.registry import RegistryEntry

# ---------------------------------------------------------------------------------------------
# helpers


def make_rl_batch(
    *,
    batch_size: int = 6,
    prompt_len: int = 4,
    max_response_len: int = 6,
    vocab_size: int = 40,
    group_size: int = 3,
    seed: int = 0,
    aggregation: str = "token-mean",
) -> TensorBatch:
    """A right-padded RL batch with every key of :mod:`core_rl.protocol` (random content).

    Token ids are drawn from ``[4, vocab_size)`` (0..3 are special in the tiny tokenizer); response
    lengths vary from 1 to ``max_response_len``; ``old_logprobs`` and ``ref_logprobs`` are random
    negative values on response tokens.
    """
    g = torch.Generator().manual_seed(seed)
    width = prompt_len + max_response_len
    input_ids = torch.zeros(batch_size, width, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    response_mask = torch.zeros(batch_size, width)
    for i in range(batch_size):
        r = 1 + (i * 5 + seed) % max_response_len
        input_ids[i, : prompt_len + r] = torch.randint(4, vocab_size, (prompt_len + r,), generator=g)
        attention_mask[i, : prompt_len + r] = 1
        response_mask[i, prompt_len : prompt_len + r] = 1.0
    old = -torch.rand(batch_size, width, generator=g) * response_mask * 3
    ref = -torch.rand(batch_size, width, generator=g) * response_mask * 3
    rewards = torch.rand(batch_size, generator=g)
    advantages = torch.randn(batch_size, 1, generator=g) * response_mask
    return TensorBatch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "old_logprobs": old,
            "ref_logprobs": ref,
            "advantages": advantages,
            "rewards": rewards,
            "group_index": torch.arange(batch_size) // group_size,
            "loss_weight": aggregation_weights(response_mask, aggregation),
        }
    )


def make_reward_input(
    response: str, row: dict[str, Any] | None = None, *, prompt: str = "", finish_reason: str = "stop"
) -> RewardInput:
    """A :class:`RewardInput` for reward tests (token ids are the characters' code points)."""
    return RewardInput(
        prompt_text=prompt,
        response_text=response,
        prompt_ids=[ord(c) for c in prompt],
        response_ids=[ord(c) for c in response],
        row=row or {},
        finish_reason=finish_reason,
    )


def installed_distribution(name: str) -> str | None:
    """``name`` if that distribution is installed, else ``None``: for a contract's ``distribution``
    in tests that also run from a plain checkout (the entry-point check then skips)."""
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return None
    return name


def _nll_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Supervised loss on response tokens (for engine tests)."""
    return LossOutput(per_token_loss=-logprobs, token_metrics={"neg_logprob": -logprobs.detach()})


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

    def host(self) -> PluginHost:
        host = PluginHost(entry_points=[])
        host.register_plugin(self.plugin, distribution=self.distribution or "<test>")
        return host

    def entry(self) -> RegistryEntry:
        return self.host().get(self.kind, self.name)

    def config(self, **overrides: Any) -> Any:
        entry = self.entry()
        if entry.config_cls is None:
            return None
        return structure({**self.options, **overrides}, entry.config_cls, path=self.kind.key)

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

    def test_shape_and_mask(self) -> None:
        batch = make_rl_batch()
        adv = self.make()(batch)
        assert adv.shape == batch["response_mask"].shape
        assert torch.isfinite(adv).all()
        assert (adv[batch["response_mask"] == 0] == 0).all()

    def test_deterministic(self) -> None:
        batch = make_rl_batch(seed=3)
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


class RewardContract(ComponentContract):
    """A reward returns one float per input, in order; ``examples`` pins (input, expected score)."""

    kind = REWARD
    examples: ClassVar[list[tuple[RewardInput, float]]] = []

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
        assert algorithm.advantage is not None and algorithm.loss is not None
        validate_plugin_section(host, ADVANTAGE, algorithm.advantage, "algorithm.advantage")
        validate_plugin_section(host, POLICY_LOSS, algorithm.loss, "algorithm.loss")
        for i, spec in enumerate(algorithm.filters):
            validate_plugin_section(host, SAMPLE_FILTER, spec, f"algorithm.filters[{i}]")


# ---------------------------------------------------------------------------------------------
# engines


class _TinyModelMixin:
    #: keyword arguments of :func:`core_rl.testing.tiny.build_tiny_model` (e.g. ``num_heads=2`` for
    #: servers whose attention kernels need a head size of at least 32)
    tiny_model_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from core_rl.testing.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **cls.tiny_model_options)


def hf_logprobs(
    model_path: Path | str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference log-probs [B, T] from a plain transformers forward (position t scores token t)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = lp
    return out * attention_mask


class TrainEngineContract(_TinyModelMixin, ComponentContract):
    """A train engine on a tiny model (one process): log-probs agree with transformers, training
    lowers a loss, micro-batching does not change the update, weights export and state resumes."""

    kind = TRAIN_ENGINE
    logprob_atol: ClassVar[float] = 1e-4

    def make(
        self,
        model_path: Path,
        *,
        trainable: bool = True,
        max_tokens_per_mb: int = 4096,
        optimizer: OptimizerConfig | None = None,
    ) -> TrainEngine:
        actor = ActorConfig(
            model_path=str(model_path),
            engine=PluginSpec(name=self.name, options=dict(self.options)),
            optimizer=optimizer or OptimizerConfig(name="sgd", lr=0.1),
            micro_batch=MicroBatchConfig(max_tokens_per_mb=max_tokens_per_mb),
        )
        engine = self.entry().factory(actor, self.config(), trainable=trainable)
        assert isinstance(engine, TrainEngine)
        return engine

    def test_logprobs_match_transformers(self, model_path: Path) -> None:
        engine = self.make(model_path, trainable=False)
        batch = make_rl_batch()
        for temperature in (1.0, 0.7):
            got = engine.compute_logprobs(batch, temperature=temperature)
            want = hf_logprobs(model_path, batch["input_ids"], batch["attention_mask"], temperature)
            assert got.shape == batch["input_ids"].shape
            assert (got[:, 0] == 0).all() and (got[batch["attention_mask"] == 0] == 0).all()
            torch.testing.assert_close(got, want, atol=self.logprob_atol, rtol=0)
        engine.close()

    def test_train_step_metrics_and_step_count(self, model_path: Path) -> None:
        engine = self.make(model_path)
        assert engine.step == 0
        metrics = engine.train_step(make_rl_batch(), _nll_loss)
        assert engine.step == 1
        for key in ("loss", "grad_norm", "lr", "entropy", "neg_logprob"):
            assert key in metrics and math.isfinite(metrics[key]), key
        engine.close()

    def test_training_lowers_loss(self, model_path: Path) -> None:
        engine = self.make(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        batch = make_rl_batch()
        losses = [engine.train_step(batch, _nll_loss)["loss"] for _ in range(6)]
        assert losses[-1] < losses[0] * 0.8, losses
        engine.close()

    def test_micro_batching_does_not_change_update(self, model_path: Path) -> None:
        batch = make_rl_batch(batch_size=6)
        whole = self.make(model_path, max_tokens_per_mb=10_000)
        split = self.make(model_path, max_tokens_per_mb=batch["input_ids"].shape[1] * 2)
        m1 = whole.train_step(batch, _nll_loss)
        m2 = split.train_step(batch, _nll_loss)
        assert m2.get("num_micro_batches", 3) > 1
        assert math.isclose(m1["loss"], m2["loss"], rel_tol=1e-5)
        sd1, sd2 = whole.full_state_dict(), split.full_state_dict()
        for key in sd1:
            torch.testing.assert_close(sd1[key], sd2[key], atol=1e-6, rtol=1e-5)
        whole.close()
        split.close()

    def test_export_hf_loads_in_transformers(self, model_path: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        engine = self.make(model_path)
        batch = make_rl_batch()
        engine.train_step(batch, _nll_loss)
        out = tmp_path / "export"
        engine.export_hf(out)
        AutoTokenizer.from_pretrained(out)
        model = AutoModelForCausalLM.from_pretrained(out)
        assert set(engine.full_state_dict()) == set(model.state_dict())
        want = hf_logprobs(out, batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(engine.compute_logprobs(batch), want, atol=self.logprob_atol, rtol=0)
        engine.close()

    def test_save_and_load_state_resume_identically(self, model_path: Path, tmp_path: Path) -> None:
        opt = OptimizerConfig(name="adamw", lr=1e-2)
        batches = [make_rl_batch(seed=s) for s in range(3)]
        a = self.make(model_path, optimizer=opt)
        a.train_step(batches[0], _nll_loss)
        a.save_state(tmp_path / "ckpt", {"data_position": 7})
        a.train_step(batches[1], _nll_loss)
        final_a = a.full_state_dict()
        b = self.make(model_path, optimizer=opt)
        extra = b.load_state(tmp_path / "ckpt")
        assert extra["data_position"] == 7 and b.step == 1
        b.train_step(batches[1], _nll_loss)
        for key, value in b.full_state_dict().items():
            torch.testing.assert_close(value, final_a[key], atol=1e-6, rtol=1e-5)
        a.close()
        b.close()


class RolloutEngineContract(_TinyModelMixin, ComponentContract):
    """A rollout engine on a tiny model: counts, stop rules, greedy decoding, behaviour log-probs
    that agree with a transformers forward, the per-request API (``agenerate`` from any event loop
    and thread, ``pause``/``resume``, ``health``), and weight updates by every mode the engine
    declares in ``weight_sync_modes`` that take effect and can be undone.

    ``options`` should make the engine compute in float32 so ``logprob_atol`` can stay tight.
    """

    kind = ROLLOUT_ENGINE
    logprob_atol: ClassVar[float] = 1e-3

    def make(
        self, model_path: Path, run_dir: Path | None = None, options: dict[str, Any] | None = None
    ) -> RolloutEngine:
        """Build the engine with ``options`` (default: the class's ``options``)."""
        import tempfile

        options = dict(self.options if options is None else options)
        entry = self.entry()
        config = None if entry.config_cls is None else structure(options, entry.config_cls, path=self.kind.key)
        rollout = RolloutConfig(engine=PluginSpec(name=self.name, options=options))
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="core-rl-rollout-"))
        engine = entry.factory(rollout, config, model_path=str(model_path), run_dir=run_dir)
        assert isinstance(engine, RolloutEngine)
        return engine

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_path: Path, tmp_path_factory: pytest.TempPathFactory):
        engine = cls().make(model_path, tmp_path_factory.mktemp("rollout-run"))
        yield engine
        engine.close()

    prompts: ClassVar[list[list[int]]] = [[1, 10, 11, 12], [1, 20, 21]]

    def test_counts_and_shapes(self, engine: RolloutEngine) -> None:
        out = engine.generate(self.prompts, SamplingParams(n=3, max_new_tokens=5))
        assert len(out) == len(self.prompts)
        for prompt, samples in zip(self.prompts, out):
            assert len(samples) == 3
            for s in samples:
                assert s.prompt_ids == prompt
                assert 1 <= len(s.response_ids) <= 5
                assert len(s.logprobs) == len(s.response_ids)
                assert all(lp <= 1e-6 for lp in s.logprobs)
                assert s.weight_version == engine.weight_version
                assert set(s.versions) <= {engine.weight_version}
                assert s.finish_reason in ("stop", "length")

    def test_stop_tokens_and_min_new_tokens(self, engine: RolloutEngine) -> None:
        stops = list(range(4, 40, 2))
        out = engine.generate(
            self.prompts, SamplingParams(n=4, max_new_tokens=8, min_new_tokens=3, stop_token_ids=stops)
        )
        for samples in out:
            for s in samples:
                assert len(s.response_ids) >= 3
                body = s.response_ids[3:-1] if s.finish_reason == "stop" else s.response_ids[3:]
                assert not any(t in stops for t in body), s.response_ids
                if s.finish_reason == "stop":
                    assert s.response_ids[-1] in stops or s.response_ids[-1] == 2
                else:
                    assert len(s.response_ids) == 8

    def test_greedy_is_argmax_and_top_k_one_matches(self, engine: RolloutEngine, model_path: Path) -> None:
        greedy = engine.generate(self.prompts, SamplingParams(n=2, max_new_tokens=6, greedy=True))
        topk1 = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=6, top_k=1))
        for samples, k1 in zip(greedy, topk1):
            assert samples[0].response_ids == samples[1].response_ids == k1[0].response_ids

    def test_logprobs_match_forward(self, engine: RolloutEngine, model_path: Path) -> None:
        out = engine.generate(self.prompts, SamplingParams(n=2, max_new_tokens=6, temperature=0.7))
        self._check_logprobs(out, model_path, 0.7)

    def _check_logprobs(self, out, model_path: Path, temperature: float, state_dict=None) -> None:
        for samples in out:
            for s in samples:
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                ref = hf_logprobs(model_path, ids, torch.ones_like(ids), temperature, state_dict)[0]
                got = torch.tensor(s.logprobs)
                torch.testing.assert_close(got, ref[len(s.prompt_ids) :], atol=self.logprob_atol, rtol=0)

    # -- the per-request API ----------------------------------------------------------------------

    def test_agenerate_concurrent_requests(self, engine: RolloutEngine) -> None:
        import asyncio

        prompts = [[1, 10 + i, 11, 12 + i % 3] for i in range(6)]

        async def run() -> list:
            return await asyncio.gather(*(engine.agenerate(p, SamplingParams(n=2, max_new_tokens=4)) for p in prompts))

        out = asyncio.run(run())
        assert len(out) == len(prompts)
        for prompt, samples in zip(prompts, out):
            assert len(samples) == 2
            assert all(s.prompt_ids == prompt and 1 <= len(s.response_ids) <= 4 for s in samples)

    def test_agenerate_from_several_threads(self, engine: RolloutEngine) -> None:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        def one(prompt: list[int]) -> list:
            return asyncio.run(engine.agenerate(prompt, SamplingParams(n=1, max_new_tokens=3, greedy=True)))

        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, [self.prompts[0]] * 3))
        assert results[0][0].response_ids == results[1][0].response_ids == results[2][0].response_ids

    def test_pause_holds_requests_until_resume(self, engine: RolloutEngine) -> None:
        import asyncio

        async def run() -> tuple[bool, list]:
            engine.pause("wait")
            try:
                task = asyncio.ensure_future(engine.agenerate(self.prompts[0], SamplingParams(n=2, max_new_tokens=3)))
                await asyncio.sleep(1.0)
                held = not task.done()
            finally:
                engine.resume()
            return held, await asyncio.wait_for(task, 300)

        held, samples = asyncio.run(run())
        assert held, "a request submitted while paused finished before resume()"
        assert len(samples) == 2

    def test_health(self, engine: RolloutEngine) -> None:
        health = engine.health()
        assert health and all(health.values()), health

    def test_invalid_request_is_rejected(self, engine: RolloutEngine) -> None:
        import asyncio

        with pytest.raises(ValueError):
            asyncio.run(engine.agenerate([], SamplingParams(n=1, max_new_tokens=3)))

    # -- weights ----------------------------------------------------------------------------------

    def _push(self, engine: RolloutEngine, mode: str, state: dict[str, torch.Tensor], version: int, tmp: Path) -> None:
        if mode == "memory":
            engine.update_weights(state, version)
        elif mode == "disk":
            from safetensors.torch import save_file

            tmp.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
            for name in ("config.json", "generation_config.json"):
                src = Path(self._model_path) / name
                if src.is_file():
                    (tmp / name).write_bytes(src.read_bytes())
            engine.load_weights_from_path(tmp, version)
        else:
            engine.update_weights_collective(state, version)

    def test_update_weights_takes_effect(self, engine: RolloutEngine, model_path: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self._model_path = model_path
        original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        torch.manual_seed(1)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
        greedy = SamplingParams(n=1, max_new_tokens=5, greedy=True)
        before = engine.generate(self.prompts, greedy)
        version = engine.weight_version
        for i, mode in enumerate(type(engine).weight_sync_modes):
            version += 1
            self._push(engine, mode, new, version, tmp_path / f"new_{i}")
            assert engine.weight_version == version, mode
            out = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=5))
            assert all(s.weight_version == version for samples in out for s in samples), mode
            self._check_logprobs(out, model_path, 1.0, state_dict=new)
            changed = engine.generate(self.prompts, greedy)
            assert [g[0].response_ids for g in changed] != [g[0].response_ids for g in before] or any(
                a[0].logprobs != b[0].logprobs for a, b in zip(changed, before)
            ), mode
            version += 1
            self._push(engine, mode, original, version, tmp_path / f"old_{i}")
            restored = engine.generate(self.prompts, greedy)
            assert [g[0].response_ids for g in restored] == [g[0].response_ids for g in before], mode
            out = engine.generate(self.prompts, SamplingParams(n=1, max_new_tokens=5))
            self._check_logprobs(out, model_path, 1.0)
