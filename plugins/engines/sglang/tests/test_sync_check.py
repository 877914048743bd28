"""The verified weight sync against a real SGLang server (from the managed ``sglang`` server
environment): after a correct ``disk`` and ``collective`` update the server's parameters, read back
through SGLang's ``/get_weights_by_name`` (the first rows of each tensor, its fused ``qkv_proj`` and
``gate_up_proj`` answered by their Hugging Face names), agree with the trainer's samples
(:class:`core_rl.sync.check.SyncCheck`); a tensor skipped in an update and a bfloat16 round
trip into a float32 server are each caught at the version they happen, naming the server and the
tensor; a server restarted with its old weights holds no weights of the version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.sync.check import WeightSyncMismatch
from core_rl.sync.faults import SyncFault
from core_rl.testing.sync_check import (
    assert_a_restart_without_the_weights_is_caught,
    check,
    sent_dir,
    sent_state,
    two_models,
)
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine
from safetensors.torch import load_file

pytestmark = pytest.mark.server_env("sglang")  # real SGLang servers (see the repository's conftest.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return two_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A float32 server (a bfloat16 round trip then changes what it holds)."""
    options = {"dtype": "float32", "max_running_requests": 16, "server": {"retry_backoff": 0.2, "max_restarts": 2}}
    engine = SGLangRolloutEngine(models["a"], structure(options, SGLangConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def test_a_correct_sync_passes_and_faults_are_caught(engine, models) -> None:
    sent = sent_dir(engine, 1, models["b"])
    engine.load_weights_from_path(models["b"], 1)
    metrics = check("sglang", "disk").verify(engine, sent)
    every = load_file(models["b"] / "model.safetensors")
    assert metrics["weight_sync/checked_tensors"] == len(every)  # the fused q/k/v, gate/up included

    state = load_file(models["a"] / "model.safetensors")
    engine.update_weights_collective(state, 2)
    check("sglang", "collective").verify(engine, sent_state(engine, 2, state))

    # (a) a tensor skipped on the way: the update never names it, so the check finds it not loaded
    engine.update_weights_collective(SyncFault("skip").state(every), 3)
    with pytest.raises(WeightSyncMismatch) as caught:
        check("sglang", "collective").verify(engine, sent_state(engine, 3, every))
    first = next(iter(every))
    message = str(caught.value)
    assert "weight version 3: rollout engine 'sglang' (server sglang-0" in message
    assert f"rollout.weight_sync: collective: the first tensor that differs is {first} (not loaded)" in message

    # (e) a bfloat16 round trip where float32 was expected: the float32 server holds other values,
    # read back from its own parameters
    rounded = SyncFault("bf16").state(state)
    changed = next(n for n in state if not torch.equal(rounded[n], state[n]))
    engine.update_weights_collective(rounded, 4)
    with pytest.raises(WeightSyncMismatch, match=f"the first tensor that differs is {changed} \\(fingerprint "):
        check("sglang", "collective").verify(engine, sent_state(engine, 4, state))


def test_a_server_restarted_with_its_old_weights_is_caught(engine, models) -> None:
    """(d) the server restarts and comes back with the weights it started from, not the update's."""
    assert_a_restart_without_the_weights_is_caught(engine, "sglang", models["b"], 5)
