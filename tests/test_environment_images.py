"""Image observations in the ``environment`` workflow (a vision-language model): an environment's
content parts become masked tokens holding the model's image placeholders, expanded, and the
trajectory's pixel inputs are the prompt's image then each observation's, in order. Run through the
real rollout controller and ``hf`` engine on the tiny Qwen2-VL built offline; the sampled log-probs
equal a transformers forward of the whole trajectory with all its images, and the ``fsdp`` train
engine computes the same log-probs from the trajectories' batch. Malformed parts and images that
cannot be used are one line naming the environment."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from core_rl.data.prompts import PromptItem
from core_rl.errors import PluginFault
from core_rl.hookspecs import hookimpl
from core_rl.protocol import samples_to_batch
from core_rl.rollout.environments import Action, Environment, StepResult, as_step_result
from core_rl.testing.multi_turn import environment_workflow, roll_out
from core_rl.testing.tiny import build_tiny_model
from core_rl.testing.tiny_vlm import IMAGE_PAD, build_tiny_llava, build_tiny_vlm
from core_rl.vision.prompts import encode_observation, encode_vision_prompt, image_markup
from PIL import Image

hf = pytest.importorskip("core_rl_hf.engine")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}


def square(colour: str, size: int = 16) -> Image.Image:
    image = Image.new("RGB", (size, size), (200, 200, 200))
    image.paste(COLOURS[colour], (4, 4, 12, 12))
    return image


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class Picture(Environment):
    """Answers each turn with a picture of the next of ``colours`` between two text parts (the
    first as a ``PIL`` image, later ones as PNG bytes in an ``image_url``-free ``image`` part);
    done after ``len(colours)`` turns, reward 1 per turn. ``image`` replaces the picture (a bad one)."""

    def __init__(self, colours: list[str], image: Any = None) -> None:
        self.colours, self.image = colours, image

    async def reset(self, row: Any) -> str:
        return ""

    async def step(self, action: Action) -> StepResult:
        colour = self.colours[action.turn]
        picture = square(colour) if action.turn == 0 else png(square(colour))
        picture = picture if self.image is None else self.image
        parts = [
            {"type": "text", "text": "colour?"},
            {"type": "image", "image": picture},
            {"type": "text", "text": "?"},
        ]
        return StepResult(parts, 1.0, action.turn + 1 >= len(self.colours), {})


@attrs.define
class PictureConfig:
    colours: list[str] = attrs.field(factory=lambda: ["red", "blue"])
    image: Any = None


class _PicturePlugin:
    @hookimpl
    def core_rl_register_environments(self, register: Any) -> None:
        register("picture", lambda c: Picture(c.colours, c.image), config_cls=PictureConfig, description="test")


PICTURE = _PicturePlugin()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_vlm(tmp_path_factory.mktemp("env_vlm") / "model", words=[*COLOURS, "colour?"], seed=0)


@pytest.fixture(scope="module")
def tokenizer(vlm: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm)


@pytest.fixture(scope="module")
def engine(vlm: Path):
    engine = hf.HFRolloutEngine(vlm, hf.HFRolloutConfig(device="cpu", seed=0))
    yield engine
    engine.close()


def image_prompts(tokenizer) -> list[PromptItem]:
    """Two prompts, each with one image of its own (the row's), as the data loader makes them."""
    items = []
    for colour in ("green", "red"):
        row = {"prompt": "colour?", "images": [png(square(colour))]}
        ids, text, media = encode_vision_prompt(
            row, "colour?", tokenizer, image_key="images", max_images=4, system_prompt=None, template_kwargs={}
        )
        items.append(PromptItem(row=row, text=text, prompt_ids=ids, media=media))
    return items


def test_the_markup_of_an_image_part_is_the_chat_templates(tmp_path: Path, tokenizer) -> None:
    from transformers import AutoTokenizer

    assert image_markup(tokenizer) == f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"
    llava = AutoTokenizer.from_pretrained(build_tiny_llava(tmp_path / "llava", seed=0))
    assert image_markup(llava) == "<image>\n"
    ids, media = encode_observation([{"type": "text", "text": "red"}], tokenizer)
    assert ids == tokenizer.encode("red", add_special_tokens=False) and media is None
    ids, media = encode_observation(
        [{"type": "text", "text": "red"}, {"type": "image", "image": square("red")}], tokenizer
    )
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    (t, h, w) = media["image_grid_thw"][0].tolist()
    assert ids.count(pad) == t * h * w // 4 and media["pixel_values"].shape[0] == t * h * w  # merge_size 2


def test_image_observations_are_masked_placeholders_and_join_the_trajectorys_pixels(
    vlm: Path, tokenizer, engine
) -> None:
    from core_rl.testing.multimodal_contracts import reference_logprobs

    workflow = environment_workflow(
        plugins=[PICTURE], environment={"name": "picture", "colours": ["red", "blue"]}, max_turns=3, max_tokens=200
    )
    prompts = image_prompts(tokenizer)
    wave, _ = roll_out(engine, tokenizer, workflow, prompts, n=2, max_new_tokens=3)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    samples = [s for group in wave.groups for s in group]
    assert len(samples) == 4
    for prompt, group in zip(prompts, wave.groups):
        for sample in group:
            assert sample.info["turns"] == 2 and sample.info["done"]
            grid = sample.media["image_grid_thw"]
            assert grid.shape == (2, 3)  # the row's image, then the first turn's picture (the second ends it)
            per_image = [int(t * h * w) // 4 for t, h, w in grid.tolist()]
            assert sample.prompt_ids.count(pad) == per_image[0]
            masked = [t for t, m in zip(sample.response_ids, sample.token_mask) if m == 0]
            trained = [t for t, m in zip(sample.response_ids, sample.token_mask) if m == 1]
            assert masked.count(pad) == per_image[1] and pad not in trained
            assert torch.equal(sample.media["pixel_values"][: grid[0].prod()], prompt.media["pixel_values"])
            assert sample.media["pixel_values"].shape[0] == sum(int(t * h * w) for t, h, w in grid.tolist())
    # every sampled token's log-prob: a forward of the whole trajectory with both images
    for sample, expected in zip(samples, reference_logprobs(vlm, samples)):
        sampled = torch.tensor(sample.token_mask) == 1
        assert torch.allclose(torch.tensor(sample.logprobs)[sampled], expected[sampled], atol=1e-4)

    # the train engine computes the same log-probs from the batch the trajectories make
    pytest.importorskip("core_rl_fsdp")
    from vlm_ranks_worker import train_engine

    batch = samples_to_batch(samples, [i // 2 for i in range(len(samples))], pad_token_id=0)
    trainer = train_engine("fsdp", vlm)
    logprobs = trainer.compute_logprobs(batch)
    mask = batch["response_mask"].bool()
    assert torch.allclose(logprobs[mask], batch["behave_logprobs"][mask], atol=1e-4)
    trainer.close()


def test_an_image_the_model_cannot_use_is_one_line_naming_the_environment(tmp_path: Path, tokenizer, engine) -> None:
    workflow = environment_workflow(
        plugins=[PICTURE], environment={"name": "picture", "image": b"not an image"}, max_turns=2
    )
    with pytest.raises(PluginFault, match=r"environment 'picture'.*observation with an image that cannot be used"):
        roll_out(engine, tokenizer, workflow, image_prompts(tokenizer)[:1], n=1, max_new_tokens=2)
    # a text-only model has no image processor
    text_model = build_tiny_model(tmp_path / "text", alphabet="abc=?", seed=0)
    text_engine = hf.HFRolloutEngine(text_model, hf.HFRolloutConfig(device="cpu", seed=0))
    from core_rl.testing.multi_turn import PromptRow
    from transformers import AutoTokenizer

    text_tokenizer = AutoTokenizer.from_pretrained(text_model)
    workflow = environment_workflow(plugins=[PICTURE], environment={"name": "picture"}, max_turns=2)
    try:
        with pytest.raises(PluginFault, match=r"environment 'picture'.*no image processor"):
            roll_out(text_engine, text_tokenizer, workflow, [PromptRow("ab=", text_tokenizer)], n=1, max_new_tokens=2)
    finally:
        text_engine.close()


def test_observation_parts_are_checked() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert as_step_result((parts, 0.0, False, {}), "env 'x'").observation == parts
    for bad, what in [
        ([{"type": "audio"}], r"part 0 is \{'type': 'audio'\}"),
        (["text"], r"part 0 is 'text'"),
        ([{"type": "text", "text": 3}], r"text part 0 has no str 'text'"),
        (b"bytes", r" of type bytes"),
    ]:
        with pytest.raises(PluginFault, match=rf"env 'x' returned an observation.*{what}"):
            as_step_result((bad, 0.0, False, {}), "env 'x'")


def test_pixels_that_do_not_match_the_placeholders_fail_at_once(tokenizer, engine) -> None:
    """transformers raises ``StopIteration`` for more placeholders than images: it reaches the
    caller as an error, where asyncio would have dropped it and left the caller waiting."""
    import asyncio

    from core_rl.interfaces import SamplingParams

    first, second = image_prompts(tokenizer)
    ids = first.prompt_ids + second.prompt_ids  # two images' placeholders, one image's pixels
    sampling = SamplingParams(n=1, max_new_tokens=2, temperature=1.0)
    with pytest.raises(RuntimeError, match="StopIteration"):
        asyncio.run(asyncio.wait_for(engine.agenerate(ids, sampling, media=first.media), timeout=60))
