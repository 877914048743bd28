"""Contract test classes of train engines and rollout engines (see :mod:`core_rl.testing`): built on
a tiny model offline, one process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from core_rl.config.converter import structure
from core_rl.config.schema import (
    ActorConfig,
    MicroBatchConfig,
    OptimizerConfig,
    PluginSpec,
    RolloutConfig,
)
from core_rl.interfaces import (
    LossOutput,
    RolloutEngine,
    SamplingParams,
    TrainEngine,
)
from core_rl.kinds import (
    ROLLOUT_ENGINE,
    TRAIN_ENGINE,
)
from core_rl.protocol import TensorBatch
from core_rl.testing.contracts import ComponentContract
from core_rl.testing.helpers import hf_logprobs, make_rl_batch
from core_rl.testing.multi_turn import MultiTurnEngineTests
from core_rl.testing.weight_transfer import check_weight_buckets

# ---------------------------------------------------------------------------------------------
# engines


def _nll_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
    """Supervised loss on response tokens (for engine tests)."""
    return LossOutput(per_token_loss=-logprobs, token_metrics={"neg_logprob": -logprobs.detach()})


class _TinyModelMixin:
    #: keyword arguments of :func:`core_rl.testing.tiny.build_tiny_model` (e.g. ``num_heads=2`` for
    #: servers whose attention kernels need a head size of at least 32)
    tiny_model_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from core_rl.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **cls.tiny_model_options)


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
        head: str = "lm",
    ) -> TrainEngine:
        actor = ActorConfig(
            model_path=str(model_path),
            engine=PluginSpec(name=self.name, options=dict(self.options)),
            optimizer=optimizer or OptimizerConfig(name="sgd", lr=0.1),
            micro_batch=MicroBatchConfig(max_tokens_per_mb=max_tokens_per_mb),
        )
        kwargs: dict[str, Any] = {"trainable": trainable}
        if head != "lm":
            kwargs["head"] = head
        engine = self.entry().factory(actor, self.config(), **kwargs)
        assert isinstance(engine, TrainEngine)
        return engine

    def _value_engine(self, model_path: Path, **kwargs: Any) -> TrainEngine:
        """A value-head engine, or a skip for an engine whose config class lists no ``value`` head."""
        if "value" not in tuple(getattr(self.entry().config_cls, "heads", ("lm",))):
            pytest.skip(f"{self.name} declares no value head (config_cls.heads)")
        return self.make(model_path, head="value", **kwargs)

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

    def test_hf_weight_buckets_hold_the_full_state_dict(self, model_path: Path) -> None:
        """Buckets (here of about 4 KiB, so several where the engine splits) hold, together and each
        name once, what :meth:`TrainEngine.full_state_dict` holds, after an update too; a tied
        weight repeated there under a second name may be left out."""
        engine = self.make(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        check_weight_buckets(engine)
        engine.train_step(make_rl_batch(), _nll_loss)
        check_weight_buckets(engine)
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

    def test_non_finite_loss_skips_the_update(self, model_path: Path) -> None:
        engine = self.make(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1))
        before = engine.full_state_dict()

        def nan_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
            return LossOutput(per_token_loss=logprobs * float("nan"))

        metrics = engine.train_step(make_rl_batch(), nan_loss)
        assert metrics["nonfinite"] == 1.0 and engine.step == 1
        for key, value in engine.full_state_dict().items():
            assert torch.equal(value, before[key]), key
        assert engine.train_step(make_rl_batch(), _nll_loss)["nonfinite"] == 0.0
        engine.close()

    def test_check_checkpoint(self, model_path: Path, tmp_path: Path) -> None:
        from core_rl.checkpointing import CheckpointFormatError

        engine = self.make(model_path)
        engine.train_step(make_rl_batch(), _nll_loss)
        engine.save_state(tmp_path / "ckpt", {"n": 1})
        engine.check_checkpoint(tmp_path / "ckpt")
        with pytest.raises(CheckpointFormatError):
            engine.check_checkpoint(tmp_path / "missing")
        engine.close()

    # -- value head (engines whose config class lists "value" in ``heads``; others skip) ------

    def test_value_head_matches_transformers_after_export(self, model_path: Path, tmp_path: Path) -> None:
        from transformers import AutoModelForTokenClassification

        engine = self._value_engine(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        batch = _with_returns(make_rl_batch())
        start = engine.compute_values(batch)
        assert start.shape == batch["input_ids"].shape and torch.equal(start, torch.zeros_like(start))
        metrics = engine.train_value_step(batch, _mse_value_loss)
        for key in ("loss", "grad_norm", "lr", "nonfinite"):
            assert key in metrics and math.isfinite(metrics[key]), key
        values = engine.compute_values(batch)
        assert (values[:, 0] == 0).all() and (values[batch["attention_mask"] == 0] == 0).all()
        assert values.abs().sum() > 0
        engine.export_hf(tmp_path / "critic")
        model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
        want = torch.zeros_like(values)
        want[:, 1:] = out[:, :-1] * batch["attention_mask"][:, 1:]
        torch.testing.assert_close(values, want, atol=self.logprob_atol, rtol=0)
        engine.close()

    def test_value_training_lowers_value_loss(self, model_path: Path) -> None:
        engine = self._value_engine(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        batch = _with_returns(make_rl_batch())
        losses = [engine.train_value_step(batch, _mse_value_loss)["loss"] for _ in range(8)]
        assert losses[-1] < losses[0] * 0.5, losses
        engine.close()

    def test_value_micro_batching_does_not_change_update(self, model_path: Path) -> None:
        batch = _with_returns(make_rl_batch(batch_size=6))
        whole = self._value_engine(model_path, max_tokens_per_mb=10_000)
        split = self._value_engine(model_path, max_tokens_per_mb=batch["input_ids"].shape[1] * 2)
        for _ in range(2):  # the head starts at 0: the second step also moves the backbone
            m1, m2 = whole.train_value_step(batch, _mse_value_loss), split.train_value_step(batch, _mse_value_loss)
        assert m2.get("num_micro_batches", 3) > 1
        assert math.isclose(m1["loss"], m2["loss"], rel_tol=1e-5)
        torch.testing.assert_close(whole.compute_values(batch), split.compute_values(batch), atol=1e-5, rtol=1e-5)
        whole.close()
        split.close()

    def test_score_head_exports_a_sequence_classifier(self, model_path: Path, tmp_path: Path) -> None:
        """``head="score"`` (engines listing it): a value model without a bias in its head whose
        export loads as ``AutoModelForSequenceClassification``, scoring each row at its last token
        as the engine's value one position later (an extra attended column) does."""
        from transformers import AutoModelForSequenceClassification

        if "score" not in tuple(getattr(self.entry().config_cls, "heads", ("lm",))):
            pytest.skip(f"{self.name} declares no score head (config_cls.heads)")
        engine = self.make(model_path, head="score", optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        batch = _with_returns(make_rl_batch())
        for _ in range(2):  # the head starts at 0: the second step also moves the backbone
            engine.train_value_step(batch, _mse_value_loss)
        rows, lengths = torch.arange(batch.batch_size), batch["attention_mask"].sum(1)
        slot = TensorBatch(
            {
                "input_ids": torch.nn.functional.pad(batch["input_ids"], (0, 1)),
                "attention_mask": torch.nn.functional.pad(batch["attention_mask"], (0, 1)),
            }
        )
        slot["attention_mask"][rows, lengths] = 1
        scores = engine.compute_values(slot)[rows, lengths]
        assert "score.bias" not in engine.full_state_dict()
        engine.export_hf(tmp_path / "rm")
        engine.close()
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
        assert type(model).__name__.endswith("ForSequenceClassification") and model.config.num_labels == 1
        with torch.no_grad():
            want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        assert want.abs().max() > 0
        torch.testing.assert_close(scores, want, atol=self.logprob_atol, rtol=0)

    def test_value_state_resumes_identically(self, model_path: Path, tmp_path: Path) -> None:
        opt = OptimizerConfig(name="adamw", lr=1e-2)
        batches = [_with_returns(make_rl_batch(seed=s)) for s in range(3)]
        a = self._value_engine(model_path, optimizer=opt)
        a.train_value_step(batches[0], _mse_value_loss)
        a.save_state(tmp_path / "ckpt", {"n": 3})
        a.train_value_step(batches[1], _mse_value_loss)
        b = self._value_engine(model_path, optimizer=opt)
        assert b.load_state(tmp_path / "ckpt")["n"] == 3 and b.step == 1
        b.train_value_step(batches[1], _mse_value_loss)
        torch.testing.assert_close(b.compute_values(batches[2]), a.compute_values(batches[2]), atol=1e-6, rtol=1e-5)
        want = a.full_state_dict()
        for key, value in b.full_state_dict().items():
            torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5)
        a.close()
        b.close()


def _with_returns(batch: TensorBatch) -> TensorBatch:
    """``batch`` with value targets ``returns`` (a fixed pattern over the response)."""
    width = batch["input_ids"].shape[1]
    batch["returns"] = torch.linspace(-1.0, 1.0, width)[None, :] * batch["response_mask"]
    return batch


def _mse_value_loss(batch: TensorBatch, values: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=0.5 * (values - batch["returns"]).square() * batch["response_mask"])


class RolloutEngineContract(_TinyModelMixin, MultiTurnEngineTests, ComponentContract):
    """A rollout engine on a tiny model: counts, stop rules, greedy decoding, behaviour log-probs
    that agree with a transformers forward, the per-request API (``agenerate`` from any event loop
    and thread, ``pause``/``resume``, ``health``), and weight updates by every mode the engine
    declares in ``weight_sync_modes`` (``memory`` both whole and in buckets) that take effect and
    can be undone.

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
        elif mode == "buckets":  # what weight_sync: memory calls, with the weights in three buckets
            keys = list(state)
            engine.update_weights_from_buckets(({k: state[k] for k in keys[i::3]} for i in range(3)), version)
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
        modes = type(engine).weight_sync_modes
        for i, mode in enumerate([*modes, "buckets"] if "memory" in modes else modes):
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

    def test_state_dict_round_trips_through_a_checkpoint(self, engine: RolloutEngine, tmp_path: Path) -> None:
        """Whatever :meth:`RolloutEngine.state_dict` holds is a state tree a checkpoint can store,
        and loading it back is accepted."""
        from core_rl.checkpointing import load_tree, save_tree

        save_tree(tmp_path, "rollout", engine.state_dict())
        engine.load_state_dict(load_tree(tmp_path, "rollout"))
