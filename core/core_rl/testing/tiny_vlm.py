"""A tiny Qwen2-VL-shaped vision-language model built offline (no model hub), for examples and tests.

:func:`build_tiny_vlm` writes a directory that ``AutoModelForImageTextToText``, ``AutoTokenizer`` and
``AutoImageProcessor`` reload offline: a random-weight ``Qwen2VLForConditionalGeneration`` (a small
vision tower of ``vision_depth`` blocks whose patch merger projects into a small language model;
``family`` ``qwen2_5_vl`` or ``qwen3_vl`` for the same shape in Qwen2.5-VL's layout, a windowed
tower with a last full-attention block, or Qwen3-VL's, learnt position embeddings and deep-stack
features into the first layers of a Qwen3 language model, with interleaved M-RoPE), a
byte-level BPE tokenizer trained on the given words with the Qwen2-VL special tokens, a chat template
that renders OpenAI/HF content parts (an image part becomes
``<|vision_start|><|image_pad|><|vision_end|>``) and Qwen2-VL's image processor with a small patch.

An image of ``H x W`` pixels (multiples of ``patch_size * merge_size``) becomes
``(H / patch_size) * (W / patch_size)`` patches of ``3 * 2 * patch_size**2`` values and
``H * W / (patch_size * merge_size)**2`` ``<|image_pad|>`` tokens in the prompt
(:mod:`core_rl.vision.prompts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

#: the Qwen2-VL family's special tokens, ids 0.. in this order
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)
PAD, EOS, IMAGE_PAD = "<|endoftext|>", "<|im_end|>", "<|image_pad|>"

#: the Qwen vision-language families :func:`build_tiny_vlm` builds: transformers' config and model classes
QWEN_VL_FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
}

#: Qwen2-VL's chat layout (ChatML) over content parts: a string content as it is; a list of parts
#: in order, ``{"type": "image", ...}`` (or ``image_url``) as the vision placeholder, ``{"type":
#: "text", "text": ...}`` as its text
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_bpe_tokenizer(
    words: Sequence[str],
    vocab_size: int = 300,
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    eos: str = EOS,
    pad: str = PAD,
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained offline on ``words`` (each word and the
    text of all of them), with ``special_tokens`` first (the Qwen2-VL family's by default); pad
    ``pad``, EOS ``eos``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    corpus = [*words, " ".join(words), "user assistant system"]
    bpe.train_from_iterator(corpus * 4, vocab_size=vocab_size, min_frequency=1, special_tokens=list(special_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eos, pad_token=pad)


def build_tiny_vlm(
    path: str | Path,
    *,
    words: Sequence[str] = ("red", "green", "blue", "yellow", "colour", "square", "?"),
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    vision_heads: int = 2,
    patch_size: int = 4,
    merge_size: int = 2,
    min_pixels: int = 8 * 8,
    max_pixels: int = 64 * 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
    family: str = "qwen2_vl",
) -> Path:
    """Write the random-weight tiny Qwen2-VL model (or ``family``'s: one of :data:`QWEN_VL_FAMILIES`),
    tokenizer, chat template and image processor to ``path`` (see the module docstring); return
    ``path``. ``words``: what the tokenizer's merges are trained on (the task's vocabulary);
    ``min_pixels``/``max_pixels`` bound the resized image."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family not in QWEN_VL_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(QWEN_VL_FAMILIES)}, got {family!r}")
    config_class, model_class = (getattr(transformers, name) for name in QWEN_VL_FAMILIES[family])

    from core_rl.roles.hf import save_pretrained

    path = Path(path)
    tokenizer = build_bpe_tokenizer(words)
    tokenizer.chat_template = CHAT_TEMPLATE
    token = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    # M-RoPE splits a head's rotary half into temporal, height and width sections
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rope_scaling": {"type": "mrope", "mrope_section": sections},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": token(EOS),
        "pad_token_id": token(PAD),
    }
    vision_config = {
        "depth": vision_depth,
        "embed_dim": vision_embed_dim,
        "hidden_size": hidden_size,
        "num_heads": vision_heads,
        "mlp_ratio": 2,
        "in_channels": 3,
        "in_chans": 3,  # the published checkpoints' name for it, which SGLang's Qwen2-VL reads
        "patch_size": patch_size,
        "spatial_merge_size": merge_size,
        "temporal_patch_size": 2,
    }
    if family != "qwen2_vl":  # the tower's own width, projected to the language model's by its merger
        vision_config.update(
            hidden_size=vision_embed_dim, out_hidden_size=hidden_size, intermediate_size=2 * vision_embed_dim
        )
    if family == "qwen2_5_vl":  # windows of 2 x 2 merged patches; the last block attends to the whole image
        vision_config.update(window_size=2 * patch_size * merge_size, fullatt_block_indexes=[vision_depth - 1])
    if family == "qwen3_vl":
        # learnt position embeddings on a grid (interpolated to each image's), deep-stack features
        # from the first block into the first layer; M-RoPE's sections interleaved
        vision_config.update(num_position_embeddings=16 * 16, deepstack_visual_indexes=[0])
        del text_config["rope_scaling"]
        text_config.update(
            head_dim=head_dim,
            rope_parameters={"rope_type": "default", "mrope_section": sections, "mrope_interleaved": True},
        )
    config = config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token(IMAGE_PAD),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = token(EOS)
    model.generation_config.pad_token_id = token(PAD)
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path


#: the LLaVA family's special tokens (Llama's, and the image placeholder), ids 0.. in this order
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
LLAVA_IMAGE = "<image>"

#: LLaVA-1.5's chat layout (``USER: <image>\n... ASSISTANT:``) over content parts; a turn ends with ``</s>``
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<image>\n"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}</s>{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tiny_llava(
    path: str | Path,
    *,
    words: Sequence[str] = ("red", "green", "blue", "yellow", "colour", "square", "?"),
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vision_layers: int = 2,
    vision_hidden_size: int = 32,
    vision_heads: int = 2,
    image_size: int = 16,
    patch_size: int = 4,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """A random-weight tiny LLaVA (``LlavaForConditionalGeneration``: a CLIP vision tower of
    ``vision_layers`` blocks over ``image_size`` pixels square in ``patch_size`` patches, a 2-layer
    MLP projector, a Llama language model), a byte-level BPE tokenizer with the family's special
    tokens (:data:`LLAVA_SPECIAL_TOKENS`), LLaVA-1.5's chat layout and CLIP's image processor (the
    PIL one: no torchvision), written to ``path``; return ``path``. Each image is resized and
    cropped to ``image_size`` and takes ``(image_size / patch_size)**2`` ``<image>`` tokens
    (``image_seq_length``: the CLS feature is dropped, LLaVA's ``default`` feature selection)."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from core_rl.roles.hf import save_pretrained

    path = Path(path)
    tokenizer = build_bpe_tokenizer(words, special_tokens=LLAVA_SPECIAL_TOKENS, eos="</s>", pad="<pad>")
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    token = tokenizer.convert_tokens_to_ids
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            num_hidden_layers=vision_layers,
            num_attention_heads=vision_heads,
            image_size=image_size,
            patch_size=patch_size,
            projection_dim=vision_hidden_size,
        ).to_dict(),
        text_config=LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=token("<s>"),
            eos_token_id=token("</s>"),
            pad_token_id=token("<pad>"),
        ).to_dict(),
        image_token_id=token(LLAVA_IMAGE),
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = token("</s>")
    model.generation_config.pad_token_id = token("<pad>")
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path
