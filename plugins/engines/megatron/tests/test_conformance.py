"""The core-rl conformance kit for train engines, run against ``megatron`` (one process, CPU, with
the test-only CUDA shim of ``conftest.py``)."""

from __future__ import annotations

from typing import ClassVar

import core_rl_megatron.plugin
from core_rl.testing import TrainEngineContract, installed_distribution


class TestMegatronEngineContract(TrainEngineContract):
    plugin = core_rl_megatron.plugin
    name = "megatron"
    distribution = installed_distribution("core-rl-megatron")
    options: ClassVar[dict] = {"make_vocab_size_divisible_by": 8}

    def test_close_releases_the_model_with_the_gpu_schedule_hooks(self, model_path) -> None:
        """On a GPU the engine binds its chunks' methods into Megatron's transformer config (the
        schedule's hooks, :func:`core_rl_megatron.optim.install_schedule_hooks`); ``close()`` unbinds
        them, or the config, which the engine keeps, would keep the model."""
        import gc
        import weakref

        from core_rl_megatron import optim

        engine = self.make(model_path)
        optim.install_schedule_hooks(engine.tconfig, engine.model, engine.config.ddp)
        params = [weakref.ref(p) for chunk in engine.model for p in chunk.parameters()]
        engine.close()
        gc.collect()
        assert params and [ref() for ref in params if ref() is not None] == []
