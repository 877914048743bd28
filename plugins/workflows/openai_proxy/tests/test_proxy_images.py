"""Images through the OpenAI proxy (a vision-language model): an agent's ``image_url`` parts (and
the Responses API's ``input_image``) become the trajectory's image placeholders and pixel inputs,
in the first call and in a later one (an image observation), over real HTTP with the real
``openai`` client in front of the real ``hf`` engine on a tiny Qwen2-VL built offline.

The trajectory's tokens are the first prompt with each image's placeholders expanded, the sampled
ids, and the inserted ids (the later image's placeholders among them, mask 0); its pixel inputs are
both images' in order; every sampled token's log-prob is a transformers forward's of the whole
trajectory with both images. An image that is not one is a 400 naming the request's messages."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from proxy_agents import LOG

pytest.importorskip("core_rl_hf")
AGENTS = "image_agents"
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}


def data_uri(colour: str, size: int = 16) -> str:
    image = Image.new("RGB", (size, size), (200, 200, 200))
    image.paste(COLOURS[colour], (4, 4, 12, 12))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


ROWS = [
    {"prompt": "colour?", "first": data_uri(a), "second": data_uri(b)} for a, b in (("red", "blue"), ("green", "red"))
]
#: the workflow's options: the model's own chat template (content parts), room for the images
OPTIONS = {"chat_template": "", "max_context_tokens": 400}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from core_rl.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("proxy_vlm") / "model", words=[*COLOURS, "colour?", "and?"], seed=0)


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def engine(model):
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(model, HFRolloutConfig(device="cpu", seed=0))
    yield engine
    engine.close()


def _placeholders(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_images_in_the_first_and_a_later_call_are_the_trajectorys(run_wave, model, tokenizer) -> None:
    from core_rl.testing.multimodal_contracts import reference_logprobs

    LOG.clear()
    wave, _ = run_wave(ROWS, n=2, program=f"{AGENTS}:image_then_another", **OPTIONS)
    pad = _placeholders(tokenizer)
    samples = [s for group in wave.groups for s in group]
    assert len(samples) == 4
    for sample in samples:
        assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1, sample.info
        grid = sample.media["image_grid_thw"]
        assert grid.shape == (2, 3)  # both images, in order
        per_image = [int(t * h * w) // 4 for t, h, w in grid.tolist()]  # merge_size 2
        assert sample.prompt_ids.count(pad) == per_image[0]  # the first image, expanded
        mask = sample.token_mask
        later = [t for t, m in zip(sample.response_ids, mask) if m == 0]
        assert later.count(pad) == per_image[1]  # the observation's image, inserted, never trained
        assert pad not in [t for t, m in zip(sample.response_ids, mask) if m == 1]  # never sampled
        assert sample.media["pixel_values"].shape[0] == sum(int(t * h * w) for t, h, w in grid.tolist())
    # the sampled tokens' log-probs: a forward of the whole trajectory with both images
    for sample, expected in zip(samples, reference_logprobs(model, samples)):
        sampled = torch.tensor(sample.token_mask) == 1
        got = torch.tensor(sample.logprobs)[sampled]
        assert torch.allclose(got, expected[sampled], atol=1e-4), (got, expected[sampled])
    # the two rows' first images differ, and so do their pixel inputs
    first = [s.media["pixel_values"] for s in (wave.groups[0][0], wave.groups[1][0])]
    assert not torch.equal(first[0], first[1])


def test_the_responses_api_takes_input_image(run_wave, tokenizer) -> None:
    wave, _ = run_wave(
        ROWS[:1], n=2, program=f"{AGENTS}:responses_with_an_image", chat_template="", max_context_tokens=400
    )
    for sample in wave.groups[0]:
        assert sample.media["image_grid_thw"].shape == (1, 3)
        assert _placeholders(tokenizer) in sample.prompt_ids


def test_an_image_that_is_not_one_is_a_400(run_wave) -> None:
    LOG.clear()
    wave, _ = run_wave(ROWS[:1], n=1, program=f"{AGENTS}:unreadable_image", **OPTIONS)
    [log] = LOG.values()
    assert log[0]["status"] == 400 and "an image of the request" in log[0]["message"], log[0]
    assert wave.groups[0][0].media is None  # the text call that followed carries no image
