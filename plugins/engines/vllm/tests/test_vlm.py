"""The tiny Qwen2-VL (:func:`core_rl.testing.tiny_vlm.build_tiny_vlm`, head size 32 for vLLM's CPU
attention) on a real vLLM CPU server (from the managed ``vllm`` server environment): prompts with
images pass the multimodal conformance case (``check_multimodal_rollout``: sampled tokens and their
log-probs against a transformers forward of the same ids and pixels), each prompt of a batch is
sampled with its own image, both weight sync modes reach the vision tower (and the sync check
covers its tensors), and ``core-rl train`` runs GRPO on image rows through it."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.config.loader import structure
from core_rl.testing.multimodal_contracts import (
    COLOURS,
    check_cached_prefix_keeps_its_image,
    check_image_grpo,
    check_images_reach_the_model,
    check_multimodal_rollout,
    check_vision_tower_syncs,
    warm_colour_vlm,
)
from core_rl.testing.sync_check import check, sent_dir, sent_state
from core_rl.testing.tiny_vlm import build_tiny_vlm
from core_rl_vllm.config import VLLMConfig
from core_rl_vllm.engine import VLLMRolloutEngine
from safetensors.torch import load_file

pytestmark = pytest.mark.server_env("vllm")  # real vLLM servers (see the repository's conftest.py)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", words=[*COLOURS, "colour?"], seed=0, num_heads=2)


@pytest.fixture(scope="module")
def engine(vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    """A float32 server: its log-probs then equal a float32 transformers forward's to ~1e-6."""
    engine = VLLMRolloutEngine(vlm, structure({"dtype": "float32"}, VLLMConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def test_the_vllm_engine_passes_the_multimodal_conformance_case(engine, vlm: Path) -> None:
    # the tolerance of the text conformance class (logprob_atol 2e-2): vLLM's log-probs leave the
    # placeholder tokens out of the softmax (the engine's logit bias), the reference keeps them
    samples = check_multimodal_rollout(engine, vlm, atol=2e-2)
    # against the same forward with the placeholders masked, a float32 server agrees to 1e-4; each
    # prompt was sampled with its own image; no placeholder was sampled
    check_images_reach_the_model(samples, vlm)


def test_a_cached_prefix_is_never_reused_for_another_image(engine, vlm: Path) -> None:
    check_cached_prefix_keeps_its_image(engine, vlm)


def test_weight_syncs_reach_the_vision_tower(engine, vlm: Path, tmp_path: Path) -> None:
    disk, state = check_vision_tower_syncs(engine, vlm, tmp_path)
    # the sync check fingerprints every tensor of an update (of the last one the server loaded), the
    # vision tower's included
    check("vllm", "collective").verify(engine, sent_state(engine, 2, state))
    engine.load_weights_from_path(disk, 3)
    tensors = load_file(disk / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors)  # the checkpoint's names of model.visual.*
    metrics = check("vllm", "disk").verify(engine, sent_dir(engine, 3, disk))
    assert metrics["weight_sync/checked_tensors"] == len(tensors)
    engine.load_weights_from_path(vlm, 4)  # back to the original weights for the other tests


@pytest.fixture(scope="module")
def warm_vlm(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_colour_vlm(vlm, tmp_path_factory.mktemp("warm"))


@pytest.mark.parametrize("weight_sync", ["disk", "collective"])
def test_grpo_runs_through_core_rl_train_on_image_rows(tmp_path: Path, warm_vlm: Path, weight_sync: str) -> None:
    # what is left of the log-prob mismatch is the placeholders' share that vLLM's log-probs leave
    # out (core_rl_vllm.engine)
    check_image_grpo(tmp_path, warm_vlm, {"name": "vllm", "dtype": "float32"}, weight_sync, atol=2e-2)
