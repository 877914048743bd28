"""The verified weight sync against a real vLLM server (from the managed ``vllm`` server
environment): the server's workers fingerprint the tensors of each update as they arrive, before
vLLM fuses them into ``qkv_proj``/``gate_up_proj``, and the trainer's side
(:class:`core_rl.sync.check.SyncCheck`) agrees with them after a correct ``disk`` and
``collective`` update (a bfloat16 server: the collective carries bfloat16, and both sides fold in
it); a tensor skipped in a collective update and a server restarted without the update's weights
are each caught at the version they happen, naming the server and the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
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
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import VLLMRolloutEngine
from safetensors.torch import load_file

pytestmark = pytest.mark.server_env("vllm")  # real vLLM servers (see the repository's conftest.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return two_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    options = {"dtype": "bfloat16", "server": {"retry_backoff": 0.2, "max_restarts": 2}}
    engine = VLLMRolloutEngine(models["a"], structure(options, VLLMConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def test_a_correct_disk_and_collective_sync_pass_and_faults_are_caught(engine, models) -> None:
    sent = sent_dir(engine, 1, models["b"])
    engine.load_weights_from_path(models["b"], 1)
    metrics = check("vllm", "disk").verify(engine, sent)
    assert metrics["weight_sync/checked_tensors"] == len(load_file(models["b"] / "model.safetensors"))

    state = load_file(models["a"] / "model.safetensors")  # float32; the bfloat16 server's wire is bfloat16
    engine.update_weights_collective(state, 2)
    assert "timing/sync_check_s" in check("vllm", "collective").verify(engine, sent_state(engine, 2, state))

    # (a) a tensor skipped on the way: vLLM keeps its old copy without a word; the check names it
    engine.update_weights_collective(SyncFault("skip").state(state), 3)
    with pytest.raises(WeightSyncMismatch) as caught:
        check("vllm", "collective").verify(engine, sent_state(engine, 3, state))
    first = next(iter(state))
    assert "weight version 3: rollout engine 'vllm' (server vllm-0" in str(caught.value)
    assert f"rollout.weight_sync: collective: the first tensor that differs is {first} (not loaded)" in str(
        caught.value
    )


def test_a_server_restarted_with_its_old_weights_is_caught(engine, models) -> None:
    """(d) the server restarts and comes back with the weights it started from, not the update's."""
    assert_a_restart_without_the_weights_is_caught(engine, "vllm", models["b"], 4)
