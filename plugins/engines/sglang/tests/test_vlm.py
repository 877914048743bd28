"""The tiny Qwen2-VL (:func:`core_rl.testing.tiny_vlm.build_tiny_vlm`) on a real SGLang CPU server
(from the managed ``sglang`` server environment): prompts with images pass the multimodal
conformance case (``check_multimodal_rollout``: sampled tokens and their log-probs against a
transformers forward of the same ids and pixels), the images change what the server samples, both
weight sync modes reach the vision tower, and ``core-rl train`` runs GRPO on image rows through it."""

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
from core_rl.testing.tiny_vlm import build_tiny_vlm
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine, served_name

pytestmark = pytest.mark.server_env("sglang")  # real SGLang servers (see the repository's conftest.py)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", words=[*COLOURS, "colour?"], seed=0)


@pytest.fixture(scope="module")
def engine(vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    """A float32 server: its log-probs then equal a float32 transformers forward's to ~1e-5."""
    options = {"dtype": "float32", "max_running_requests": 16, "update_bucket_mb": 0.047}
    engine = SGLangRolloutEngine(vlm, structure(options, SGLangConfig), tmp_path_factory.mktemp("run"))
    yield engine
    engine.close()


def test_the_sglang_engine_passes_the_multimodal_conformance_case(engine, vlm: Path) -> None:
    # the tolerance of the text conformance class (logprob_atol 2e-2): SGLang's log-probs leave the
    # placeholder tokens out of the softmax, the reference keeps them (~0.007 for this random model)
    samples = check_multimodal_rollout(engine, vlm, atol=2e-2)
    # against the same forward with the placeholders masked, a float32 server agrees to 1e-4; each
    # prompt was sampled with its own image; no placeholder was sampled, even where the model favours them
    check_images_reach_the_model(samples, vlm)


def test_a_cached_prefix_is_never_reused_for_another_image(engine, vlm: Path) -> None:
    check_cached_prefix_keeps_its_image(engine, vlm)


def test_weight_syncs_reach_the_vision_tower(engine, vlm: Path, tmp_path: Path) -> None:
    assert served_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert served_name("model.language_model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert served_name("lm_head.weight") == "lm_head.weight"
    check_vision_tower_syncs(engine, vlm, tmp_path)
    engine.load_weights_from_path(vlm, 3)  # back to the original weights for the other tests


@pytest.fixture(scope="module")
def warm_vlm(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return warm_colour_vlm(vlm, tmp_path_factory.mktemp("warm"))


@pytest.mark.parametrize("weight_sync", ["disk", "collective"])
def test_grpo_runs_through_core_rl_train_on_image_rows(tmp_path: Path, warm_vlm: Path, weight_sync: str) -> None:
    # what is left of the log-prob mismatch is the placeholders' share that SGLang's log-probs leave
    # out (core_rl_sglang.engine)
    engine = {"name": "sglang", "dtype": "float32", "max_running_requests": 64}
    check_image_grpo(tmp_path, warm_vlm, engine, weight_sync, atol=2e-2)
