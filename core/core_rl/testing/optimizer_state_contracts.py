"""Contract tests of a train engine's optimizer state in checkpoints and resets (mixed into
:class:`core_rl.testing.TrainEngineContract`): ``save_state(..., optimizer=False)``,
``load_state(..., optimizer=False)`` and :meth:`~core_rl.interfaces.TrainEngine.reset_optimizer`.

"A fresh optimizer" is checked against a second engine built from the same weights (exported with
``export_hf``): AdamW's first step from there (``lr * g / |g|`` elementwise, whatever came before) is
what the engine's next step must equal, which a step that kept Adam's moments and step count
misses by about ``lr``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core_rl.config.schema import OptimizerConfig
from core_rl.interfaces import TrainEngine
from core_rl.protocol import TensorBatch
from core_rl.testing.helpers import make_rl_batch, nll_loss

_ADAMW = OptimizerConfig(name="adamw", lr=1e-2)


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _assert_same_weights(got: TrainEngine, want: dict[str, torch.Tensor]) -> None:
    for key, value in got.full_state_dict().items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


class OptimizerStateContract:
    """See the module docstring. Needs the contract's ``make(model_path, *, optimizer=...)``."""

    make: Any

    def _fresh_first_step(self, engine: TrainEngine, batch: TensorBatch, where: Path) -> TrainEngine:
        """A new engine built from ``engine``'s weights (exported to ``where``), after one step on
        ``batch``; ``where/unstepped`` is its state before that step, saved with ``optimizer=False``."""
        engine.export_hf(where)
        fresh = self.make(where, optimizer=_ADAMW)
        fresh.save_state(where / "unstepped", {"n": 0}, optimizer=False)  # no state exists yet
        fresh.train_step(batch, nll_loss)
        return fresh

    def test_state_saved_without_the_optimizer_resumes_only_with_a_fresh_one(
        self, model_path: Path, tmp_path: Path
    ) -> None:
        """A checkpoint saved with ``optimizer=False`` after a step holds no optimizer files, is
        smaller by at least the weights' size (AdamW's two moments), is refused by
        ``load_state(path)`` (:class:`~core_rl.checkpoint.files.OptimizerStateLeftOut`), and with
        ``optimizer=False`` resumes weights and step with a fresh optimizer. One saved before any
        step resumes normally."""
        from core_rl.checkpoint.files import OptimizerStateLeftOut

        batches = [make_rl_batch(seed=s) for s in range(2)]
        saving = self.make(model_path, optimizer=_ADAMW)
        saving.train_step(batches[0], nll_loss)
        saving.save_state(tmp_path / "full", {"n": 1})
        saving.save_state(tmp_path / "lean", {"n": 1}, optimizer=False)
        saving.check_checkpoint(tmp_path / "lean")
        assert not [f for f in (tmp_path / "lean").rglob("*optim*") if f.name != "meta.json"]
        weights = sum(v.numel() * v.element_size() for v in saving.full_state_dict().values())
        assert _bytes(tmp_path / "full") - _bytes(tmp_path / "lean") >= weights
        fresh = self._fresh_first_step(saving, batches[1], tmp_path / "start")
        saving.close()

        resumed = self.make(model_path, optimizer=_ADAMW)
        assert resumed.load_state(tmp_path / "start" / "unstepped") == {"n": 0} and resumed.step == 0
        with pytest.raises(OptimizerStateLeftOut, match=r"recover\.load_optimizer: false"):
            resumed.load_state(tmp_path / "lean")
        assert resumed.load_state(tmp_path / "lean", optimizer=False) == {"n": 1} and resumed.step == 1
        resumed.train_step(batches[1], nll_loss)
        _assert_same_weights(resumed, fresh.full_state_dict())
        resumed.close()
        fresh.close()

    def test_state_loaded_without_the_optimizer_and_reset_optimizer_start_it_afresh(
        self, model_path: Path, tmp_path: Path
    ) -> None:
        """``load_state(path, optimizer=False)`` of a checkpoint that holds the optimizer state, and
        ``reset_optimizer()`` after steps, both leave the next step equal to a new engine's first
        step from the same weights, keeping :attr:`~TrainEngine.step`. A checkpoint saved right
        after the reset (no state then) resumes with ``load_state(path)`` as it would have gone on."""
        batches = [make_rl_batch(seed=s) for s in range(3)]
        engine = self.make(model_path, optimizer=_ADAMW)
        for batch in batches[:2]:
            engine.train_step(batch, nll_loss)
        engine.save_state(tmp_path / "ckpt", {})
        fresh = self._fresh_first_step(engine, batches[2], tmp_path / "start")
        want = fresh.full_state_dict()
        fresh.close()

        engine.reset_optimizer()
        assert engine.step == 2
        engine.save_state(tmp_path / "after_reset", {})
        engine.train_step(batches[2], nll_loss)
        _assert_same_weights(engine, want)
        engine.load_state(tmp_path / "after_reset")  # saved with no state: a normal resume
        engine.train_step(batches[2], nll_loss)
        _assert_same_weights(engine, want)

        engine.load_state(tmp_path / "ckpt", optimizer=False)
        assert engine.step == 2
        engine.train_step(batches[2], nll_loss)
        _assert_same_weights(engine, want)
        engine.load_state(tmp_path / "ckpt")  # the optimizer state kept: not what a fresh one does
        engine.train_step(batches[2], nll_loss)
        assert any(not torch.equal(v, want[k]) for k, v in engine.full_state_dict().items())
        engine.close()
