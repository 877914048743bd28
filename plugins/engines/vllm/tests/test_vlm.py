"""The tiny Qwen2-VL (:func:`core_rl.roles.tiny_vlm.build_tiny_vlm`, head size 32 for vLLM's CPU
attention) on a real vLLM CPU server (from the managed ``vllm`` server environment): prompts with
images pass the multimodal conformance case (``check_multimodal_rollout``: sampled tokens and their
log-probs against a transformers forward of the same ids and pixels), each prompt of a batch is
sampled with its own image, both weight sync modes reach the vision tower (and the sync check
covers its tensors), and ``core-rl train`` runs GRPO on image rows through it."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from core_rl.config.loader import structure
from core_rl.roles.tiny_vlm import build_tiny_vlm
from core_rl.testing.multimodal_contracts import (
    COLOURS,
    check_image_grpo,
    check_multimodal_rollout,
    masked_gaps,
    perturbed_vision_tower,
    sample_and_compare,
    save_beside,
    warm_colour_vlm,
)
from core_rl.testing.sync_check import check, sent_dir, sent_state
from core_rl.vision.models import placeholder_ids
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
    options = {"dtype": "float32", "max_num_seqs": 16}
    engine = VLLMRolloutEngine(vlm, structure(options, VLLMConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def test_the_vllm_engine_passes_the_multimodal_conformance_case(engine, vlm: Path) -> None:
    # the tolerance of the text conformance class (logprob_atol 2e-2): vLLM's log-probs leave the
    # placeholder tokens out of the softmax (the engine's logit bias), the reference keeps them
    samples = check_multimodal_rollout(engine, vlm, atol=2e-2)
    # against the same forward with the placeholders masked, a float32 server agrees to 1e-4
    assert max(masked_gaps(samples, vlm)) < 1e-4
    # the images reach the model: the same ids without the pixels give other log-probs
    blind = [attrs.evolve(s, media=None) for s in samples if s.media is not None]
    assert min(masked_gaps(blind, vlm)) > 1e-3
    # ...and each prompt of the batch was sampled with its own image, not its neighbour's
    with_images = [s for s in samples if s.media is not None]
    first, second = with_images[0].media, with_images[-1].media
    assert first is not second
    swapped = [attrs.evolve(s, media=second if s.media is first else first) for s in with_images]
    assert min(masked_gaps(swapped, vlm)) > 1e-3
    # a vision-language model's placeholders are never sampled
    placeholders = set(placeholder_ids(vlm))
    assert placeholders and all(not placeholders & set(s.response_ids) for s in samples)


def test_weight_syncs_reach_the_vision_tower(engine, vlm: Path, tmp_path: Path) -> None:
    # disk: a Hugging Face directory of the model with a perturbed vision tower
    disk = save_beside(perturbed_vision_tower(vlm, seed=1), vlm, tmp_path / "disk")
    assert max(sample_and_compare(engine, disk)) > 1e-3  # the server still holds the original tower
    engine.load_weights_from_path(disk, 1)
    assert max(sample_and_compare(engine, disk)) < 1e-4  # now the server's log-probs are the new model's
    # the sync check fingerprints every tensor of the update, the vision tower's included
    metrics = check("vllm", "disk").verify(engine, sent_dir(engine, 1, disk))
    tensors = load_file(disk / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors)  # the checkpoint's names of model.visual.*
    assert metrics["weight_sync/checked_tensors"] == len(tensors)

    # collective: the trainer's in-memory names (model.visual.*, model.language_model.*), another tower
    model = perturbed_vision_tower(vlm, seed=2)
    other = save_beside(model, vlm, tmp_path / "collective")
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    assert any(name.startswith("model.visual.") for name in state)
    assert max(sample_and_compare(engine, other)) > 1e-3
    engine.update_weights_collective(state, 2)
    assert max(sample_and_compare(engine, other)) < 1e-4
    check("vllm", "collective").verify(engine, sent_state(engine, 2, state))
    # back to the original weights for the other tests
    engine.load_weights_from_path(vlm, 3)


@pytest.fixture(scope="module")
def warm_vlm(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_colour_vlm(vlm, tmp_path_factory.mktemp("warm"))


@pytest.mark.parametrize("weight_sync", ["disk", "collective"])
def test_grpo_runs_through_core_rl_train_on_image_rows(tmp_path: Path, warm_vlm: Path, weight_sync: str) -> None:
    # what is left of the log-prob mismatch is the placeholders' share that vLLM's log-probs leave
    # out (core_rl_vllm.engine)
    engine = {"name": "vllm", "dtype": "float32", "max_num_seqs": 64}
    check_image_grpo(tmp_path, warm_vlm, engine, weight_sync, atol=2e-2)
