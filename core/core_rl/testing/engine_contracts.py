"""Contract test classes of train engines (see :mod:`core_rl.testing`; rollout engines':
:mod:`core_rl.testing.rollout_contracts`): built on a tiny model offline, one process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from core_rl.config.schema import ActorConfig, LoraConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
from core_rl.interfaces import LossOutput, TrainEngine
from core_rl.plugins.kinds import TRAIN_ENGINE
from core_rl.protocol import TensorBatch
from core_rl.testing.contracts import ComponentContract
from core_rl.testing.helpers import hf_logprobs, make_grouped_rl_batch, make_rl_batch
from core_rl.testing.helpers import nll_loss as _nll_loss
from core_rl.testing.optimizer_state_contracts import OptimizerStateContract
from core_rl.testing.topk_contracts import TopkLogprobsContract
from core_rl.testing.weight_transfer import check_weight_buckets

# ---------------------------------------------------------------------------------------------
# engines


#: the optimizers beyond AdamW and SGD every train engine is asked to train with and resume
#: (:meth:`TrainEngineContract.test_optimizer_choice_trains_and_resumes_exactly`), at rates that
#: move the tiny model's weights by about 1% a step
OPTIMIZER_CHOICES = (
    OptimizerConfig(name="adafactor", lr=1e-2, weight_decay=0.01),
    OptimizerConfig(name="muon", lr=1e-3, muon_lr=1e-2, weight_decay=0.01),
    OptimizerConfig(name="class", class_path="torch.optim:RMSprop", lr=1e-4, kwargs={"momentum": 0.5}),
)


class TinyModelMixin:
    """A class-scoped ``model_path`` fixture: a tiny model built offline (shared by the engine contracts)."""

    #: keyword arguments of :func:`core_rl.testing.tiny.build_tiny_model` (e.g. ``num_heads=2`` for
    #: servers whose attention kernels need a head size of at least 32)
    tiny_model_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from core_rl.testing.tiny import build_tiny_model

        return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **cls.tiny_model_options)

    @pytest.fixture(scope="class")
    @classmethod
    def tied_model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The tiny model with its output head tied to its input embedding (as Qwen2.5-0.5B, Qwen3-0.6B,
        Llama-3.2-1B, Gemma and SmolLM2 have it)."""
        from core_rl.testing.tiny import build_tiny_model

        options = {**cls.tiny_model_options, "tie_word_embeddings": True}
        return build_tiny_model(tmp_path_factory.mktemp("tied") / "model", seed=0, **options)


class TrainEngineContract(OptimizerStateContract, TopkLogprobsContract, TinyModelMixin, ComponentContract):
    """A train engine on a tiny model (one process): log-probs agree with transformers, training
    lowers a loss, micro-batching does not change the update, weights export and state resumes
    (with or without the optimizer state: :class:`OptimizerStateContract`), and, where the engine
    declares it, top-k log-probs and log-probs of given ids (:class:`TopkLogprobsContract`)."""

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
        fused_head: bool = False,
        lora: LoraConfig | None = None,
        layout: str = "auto",
    ) -> TrainEngine:
        actor = ActorConfig(
            model_path=str(model_path),
            engine=PluginSpec(name=self.name, options=dict(self.options)),
            optimizer=optimizer or OptimizerConfig(name="sgd", lr=0.1),
            micro_batch=MicroBatchConfig(max_tokens_per_mb=max_tokens_per_mb, layout=layout),
            fused_head=fused_head,
            lora=lora or LoraConfig(),
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

    def test_close_releases_the_model_while_the_engine_lives(self, model_path: Path) -> None:
        """After ``close()`` (and a garbage collection) no parameter of the modules the engine held is
        reachable, though the engine object still is (a trainer holds its engines until it ends):
        on a GPU that memory returns to the device for the next engine or restart."""
        import gc
        import weakref

        from torch import nn

        engine = self.make(model_path)
        engine.train_step(make_rl_batch(), _nll_loss)  # optimizer state and hooks exist too
        held = [v for value in vars(engine).values() for v in (value if isinstance(value, list) else [value])]
        params = [weakref.ref(p) for module in held if isinstance(module, nn.Module) for p in module.parameters()]
        assert params, "the engine holds no nn.Module attribute to check"
        del held  # only the engine holds the modules now
        engine.close()
        gc.collect()
        assert [ref() for ref in params if ref() is not None] == []

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

    def test_fused_head_gives_the_same_logprobs_and_update(self, model_path: Path) -> None:
        """``fused_head`` (engines whose config class sets ``fused_head = True``; others skip): the
        log-probs of the logits, and two steps (split into micro-batches) to the same weights; the
        fused computation ran for the one engine and not for the other."""
        from core_rl_train_kit import fused_head as fused_module

        if not getattr(self.entry().config_cls, "fused_head", False):
            pytest.skip(f"{self.name} does not honour fused_head (config_cls.fused_head)")
        batch = make_rl_batch(batch_size=6)
        opt = OptimizerConfig(name="adamw", lr=1e-2)
        budget = batch["input_ids"].shape[1] * 2
        plain = self.make(model_path, optimizer=opt, max_tokens_per_mb=budget)
        fused = self.make(model_path, optimizer=opt, max_tokens_per_mb=budget, fused_head=True)
        calls = {"plain": 0, "fused": 0}
        compute = fused_module.fused_head_stats

        def counted(engine: str):
            def stats(*args: Any, **kwargs: Any) -> Any:
                calls[engine] += 1
                return compute(*args, **kwargs)

            return stats

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_module, "fused_head_stats", counted("plain"))
            want_lp = plain.compute_logprobs(batch, temperature=0.7)
            patch.setattr(fused_module, "fused_head_stats", counted("fused"))
            torch.testing.assert_close(fused.compute_logprobs(batch, temperature=0.7), want_lp, atol=1e-5, rtol=0)
            assert calls["plain"] == 0 and calls["fused"] > 0, calls
        for _ in range(2):
            m_plain, m_fused = plain.train_step(batch, _nll_loss), fused.train_step(batch, _nll_loss)
            assert m_fused.get("num_micro_batches", 3) > 1
            assert math.isclose(m_fused["loss"], m_plain["loss"], rel_tol=1e-5)
            assert math.isclose(m_fused["entropy"], m_plain["entropy"], rel_tol=1e-5)
        want = plain.full_state_dict()
        for key, value in fused.full_state_dict().items():
            torch.testing.assert_close(value, want[key], atol=1e-5, rtol=1e-4, msg=key)
        plain.close()
        fused.close()

    def test_shared_prefix_layout_gives_the_padded_update(self, model_path: Path) -> None:
        """Rows in groups sharing prompts (of different lengths, with responses of different lengths,
        a group of one): under ``micro_batch.layout: shared`` the log-probs of ``padded`` and, over
        two steps in several micro-batches, the same loss, entropy and weights; the shared stream
        was built. Engines that run a micro-batch loop of their own (not
        :class:`~core_rl_train_kit.runner.MicroBatchRunner`, which the layout belongs to) skip."""
        from core_rl_train_kit import shared_prefix
        from core_rl_train_kit.runner import MicroBatchRunner

        batch = make_grouped_rl_batch()
        budget = 48  # several micro-batches in either layout; every group's stream fits in one
        padded = self.make(model_path, max_tokens_per_mb=budget, layout="padded")
        shared = self.make(model_path, max_tokens_per_mb=budget, layout="shared")
        if not isinstance(getattr(shared, "runner", None), MicroBatchRunner):
            pytest.skip(f"{self.name} runs its own micro-batch loop (the layout is MicroBatchRunner's)")
        built: list[int] = []
        share_rows = shared_prefix.share_rows

        def counted(*args: Any, **kwargs: Any) -> Any:
            built.append(len(args[2]))
            return share_rows(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(shared_prefix, "share_rows", counted)
            want_lp = padded.compute_logprobs(batch, temperature=0.7)
            assert built == []
            torch.testing.assert_close(shared.compute_logprobs(batch, temperature=0.7), want_lp, atol=1e-5, rtol=0)
            assert built, "the shared engine never built a shared stream"
            built.clear()
            for _ in range(2):
                m_padded, m_shared = padded.train_step(batch, _nll_loss), shared.train_step(batch, _nll_loss)
                assert m_shared.get("num_micro_batches", 3) > 1
                assert math.isclose(m_shared["loss"], m_padded["loss"], rel_tol=1e-5)
                assert math.isclose(m_shared["entropy"], m_padded["entropy"], rel_tol=1e-5)
            assert built
        want = padded.full_state_dict()
        for key, value in shared.full_state_dict().items():
            torch.testing.assert_close(value, want[key], atol=1e-5, rtol=1e-4, msg=key)
        padded.close()
        shared.close()

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

    # -- tied embeddings (most real models: the output head is the input embedding) ------------

    def test_tied_model_saves_and_resumes_bitwise(self, tied_model_path: Path, tmp_path: Path) -> None:
        """A model whose output head is tied to its embedding trains, saves (a checkpoint at every
        step), and a run resumed from the first checkpoint ends two steps later bit for bit where the
        uninterrupted run did, the head still tied to the embedding in both."""
        opt = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)
        batches = [make_rl_batch(seed=s) for s in range(3)]
        a = self.make(tied_model_path, optimizer=opt)
        for step, batch in enumerate(batches):
            a.train_step(batch, _nll_loss)
            a.save_state(tmp_path / f"step{step + 1}", {"step": step + 1})
        final_a = a.full_state_dict()
        a.close()
        _assert_tied(final_a)
        b = self.make(tied_model_path, optimizer=opt)
        assert b.load_state(tmp_path / "step1")["step"] == 1 and b.step == 1
        for batch in batches[1:]:
            b.train_step(batch, _nll_loss)
        final_b = b.full_state_dict()
        _assert_tied(final_b)
        assert set(final_b) == set(final_a)
        for key, value in final_b.items():
            gap = (value - final_a[key]).abs().max()
            assert torch.equal(value, final_a[key]), f"{key} differs after the resume by {gap}"
        b.close()

    def test_tied_model_with_lora_resumes_bitwise(self, tied_model_path: Path, tmp_path: Path) -> None:
        """LoRA on every linear layer of a tied model (engines that refuse LoRA skip): a run resumed
        from its first checkpoint ends bit for bit where the uninterrupted run did, the adapters
        trained and the merged head still the merged embedding."""
        lora = LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear"])
        self._skip_refused(OptimizerConfig(name="adamw"), lora=lora, key="actor.lora")
        opt = OptimizerConfig(name="adamw", lr=1e-2)
        batches = [make_rl_batch(seed=s) for s in range(3)]
        a = self.make(tied_model_path, optimizer=opt, lora=lora)
        start = a.full_state_dict()
        a.train_step(batches[0], _nll_loss)
        a.save_state(tmp_path / "step1", {})
        for batch in batches[1:]:
            a.train_step(batch, _nll_loss)
        final_a = a.full_state_dict()
        a.close()
        assert not torch.equal(
            final_a["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"]
        )
        _assert_tied(final_a)
        b = self.make(tied_model_path, optimizer=opt, lora=lora)
        b.load_state(tmp_path / "step1")
        for batch in batches[1:]:
            b.train_step(batch, _nll_loss)
        final_b = b.full_state_dict()
        b.close()
        assert set(final_b) == set(final_a)
        for key, value in final_b.items():
            assert torch.equal(value, final_a[key]), key

    def test_tied_model_exports_and_sends_its_weights(self, tied_model_path: Path, tmp_path: Path) -> None:
        """After an update, a tied model's Hugging Face export reloads in transformers still tied and
        with the engine's log-probs, and its weight buckets (what a weight sync sends) hold its full
        state, the tied weight once."""
        from transformers import AutoModelForCausalLM

        engine = self.make(tied_model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        batch = make_rl_batch()
        engine.train_step(batch, _nll_loss)
        check_weight_buckets(engine)
        names = [name for bucket in engine.hf_weight_buckets(4096) for name in bucket]
        assert len(names) == len(set(names)) and not ({"lm_head.weight", "model.embed_tokens.weight"} <= set(names))
        engine.export_hf(tmp_path / "export")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        torch.testing.assert_close(
            model.lm_head.weight, engine.full_state_dict()["model.embed_tokens.weight"], atol=0, rtol=0
        )
        want = hf_logprobs(tmp_path / "export", batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(engine.compute_logprobs(batch), want, atol=self.logprob_atol, rtol=0)
        engine.close()

    @pytest.mark.parametrize("optimizer", OPTIMIZER_CHOICES, ids=lambda o: o.name)
    def test_optimizer_choice_trains_and_resumes_exactly(
        self, model_path: Path, tmp_path: Path, optimizer: OptimizerConfig
    ) -> None:
        """Each ``actor.optimizer.name`` the engine accepts (its ``check_config`` refuses none;
        others skip) lowers the loss of a batch trained on three times, and a run resumed after the
        first step ends the next two steps with the same weights (the optimizer's own state, e.g.
        Adafactor's factored moments or Muon's momentum, saved and restored)."""
        self._skip_refused(optimizer)
        batch = make_rl_batch()
        a = self.make(model_path, optimizer=optimizer)
        first = a.train_step(batch, _nll_loss)["loss"]
        a.save_state(tmp_path / "ckpt", {})
        a.train_step(batch, _nll_loss)
        last = a.train_step(batch, _nll_loss)["loss"]
        assert last < first, f"{optimizer.name}: the loss went from {first} to {last}"
        final_a = a.full_state_dict()
        a.close()
        b = self.make(model_path, optimizer=optimizer)
        b.load_state(tmp_path / "ckpt")
        for _ in range(2):
            b.train_step(batch, _nll_loss)
        for key, value in b.full_state_dict().items():
            torch.testing.assert_close(value, final_a[key], atol=1e-6, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
        b.close()

    def _skip_refused(
        self, optimizer: OptimizerConfig, *, lora: LoraConfig | None = None, key: str = "actor.optimizer"
    ) -> None:
        """Skip when the engine refuses ``optimizer`` (or ``lora``) for the actor, a problem at ``key``:
        its ``check_config``, or its ``check_environment`` on this machine (what ``core-rl train``
        asks before loading a model)."""
        from core_rl.config.checks import EnvironmentContext, config_problems, environment_problems
        from core_rl.config.schema import RunConfig
        from core_rl.loops.preflight import detect_machine

        actor = ActorConfig(
            engine=PluginSpec(name=self.name, options=dict(self.options)),
            optimizer=optimizer,
            lora=lora or LoraConfig(),
        )
        context = EnvironmentContext(
            path="actor.engine", run=RunConfig(actor=actor), name=self.name, machine=detect_machine()
        )
        config = self.config()
        problems = [*config_problems(config, context), *environment_problems(config, context)]
        refused = [line for line in problems if key in line]
        if refused:
            pytest.skip(refused[0])

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

    def test_a_zero_gradient_step_is_the_step_of_a_zero_loss(self, model_path: Path) -> None:
        """The optimiser step a zero-signal update takes without its batch
        (:func:`core_rl.loops.rl.update.zero_gradient_step`: one two-token row, a loss of exactly 0)
        is bitwise the step of a batch whose loss is 0 on every token. After a real step (AdamW's
        moments nonzero, weight decay on) both move the weights alike (momentum and decay: not a
        no-op), report a loss and gradient norm of 0 at the same rate, and the next real step ends
        alike too (the moments and step counts agree)."""
        from core_rl.loops.rl.update import ZeroLoss, zero_gradient_step

        optimizer = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)
        full, skipped = self.make(model_path, optimizer=optimizer), self.make(model_path, optimizer=optimizer)
        for engine in (full, skipped):
            engine.train_step(make_rl_batch(seed=0), _nll_loss)
        before = full.full_state_dict()
        a = full.train_step(make_rl_batch(seed=1), ZeroLoss())
        b = zero_gradient_step(skipped, pad_token_id=0, temperature=1.0)
        assert (a["loss"], a["grad_norm"], a["nonfinite"]) == (b["loss"], b["grad_norm"], b["nonfinite"]) == (0, 0, 0)
        assert a["lr"] == b["lr"] and full.step == skipped.step == 2
        moved = full.full_state_dict()
        assert any(not torch.equal(moved[k], before[k]) for k in moved), "an update of zero moved nothing"
        for key, value in skipped.full_state_dict().items():
            assert torch.equal(value, moved[key]), key
        for engine in (full, skipped):
            engine.train_step(make_rl_batch(seed=2), _nll_loss)
        after = full.full_state_dict()
        for key, value in skipped.full_state_dict().items():
            assert torch.equal(value, after[key]), key
        full.close()
        skipped.close()

    def test_full_state_dict_is_a_snapshot(self, model_path: Path) -> None:
        """Training after :meth:`full_state_dict` leaves its tensors as they were (no storage shared
        with the parameters), so a state taken before a step can be compared with one after."""
        engine = self.make(model_path, optimizer=OptimizerConfig(name="adamw", lr=1e-2))
        state = engine.full_state_dict()
        copies = {key: value.clone() for key, value in state.items()}
        engine.train_step(make_rl_batch(), _nll_loss)
        assert any(not torch.equal(v, copies[k]) for k, v in engine.full_state_dict().items()), "training moved nothing"
        for key, value in state.items():
            assert torch.equal(value, copies[key]), f"{key} changed with training: it shares the parameter's storage"
        engine.close()

    @pytest.mark.parametrize(
        ("saved_with", "no_decay"),
        [(None, "biases_and_norms"), (None, "none"), ("none", "biases_and_norms"), ("biases_and_norms", "none")],
    )
    def test_weight_decay_spares_biases_and_norms(
        self, model_path: Path, tmp_path: Path, saved_with: str | None, no_decay: str
    ) -> None:
        """With zero gradients (and so zero Adam moments) AdamW moves a weight only by its decay,
        ``w * (1 - lr * wd)``: the matrices always, biases and norm scales only when ``no_decay``
        is ``none``. A run resumed from a checkpoint saved under the other ``no_decay`` follows its
        own configuration, not the saved parameter groups'."""
        lr, wd = 1e-2, 0.5

        def zero_loss(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
            return LossOutput(per_token_loss=logprobs * 0.0)

        engine = self.make(model_path, optimizer=OptimizerConfig(lr=lr, weight_decay=wd, no_decay=no_decay))
        if saved_with is not None:
            saving = self.make(model_path, optimizer=OptimizerConfig(lr=lr, weight_decay=wd, no_decay=saved_with))
            saving.train_step(make_rl_batch(), zero_loss)  # Adam's moments exist, and are zero
            saving.save_state(tmp_path / "ckpt", {})
            saving.close()
            engine.load_state(tmp_path / "ckpt")
        before = engine.full_state_dict()
        assert any(v.dim() < 2 for v in before.values()), "the tiny model has biases and norms"
        assert engine.train_step(make_rl_batch(), zero_loss)["nonfinite"] == 0.0
        for key, value in engine.full_state_dict().items():
            spared = no_decay == "biases_and_norms" and value.dim() < 2
            expected = before[key] if spared else before[key] * (1 - lr * wd)
            torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
        engine.close()

    def test_check_checkpoint(self, model_path: Path, tmp_path: Path) -> None:
        from core_rl.checkpoint.files import CheckpointFormatError

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


def _assert_tied(state: dict[str, torch.Tensor]) -> None:
    """The output head of a full state dict equals its input embedding (where it lists the head)."""
    if "lm_head.weight" in state:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]), "the head came untied"


def _with_returns(batch: TensorBatch) -> TensorBatch:
    """``batch`` with value targets ``returns`` (a fixed pattern over the response)."""
    width = batch["input_ids"].shape[1]
    batch["returns"] = torch.linspace(-1.0, 1.0, width)[None, :] * batch["response_mask"]
    return batch


def _mse_value_loss(batch: TensorBatch, values: torch.Tensor) -> LossOutput:
    return LossOutput(per_token_loss=0.5 * (values - batch["returns"]).square() * batch["response_mask"])
