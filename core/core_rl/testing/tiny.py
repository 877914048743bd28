"""Tiny Hugging Face models and tokenizers built offline (no model hub), for examples and tests.

:func:`build_tiny_model` writes a directory loadable by ``AutoTokenizer`` / ``AutoModelForCausalLM``:
a character-level tokenizer (one token per character of ``alphabet`` plus ``<pad>``, ``<s>``,
``</s>``, ``<unk>``) and a random-weight Llama (default), Qwen2 or Qwen3-MoE model (a
mixture-of-experts model: ``num_experts`` experts per layer, ``top_k`` of them per token).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " =+-?:>"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: :func:`build_tiny_model` arguments of Qwen2-0.5B's and Qwen2-1.5B's layouts (pass
#: ``architecture="qwen2"`` and ``tie_word_embeddings=True`` too); with a character vocabulary instead
#: of their 152k tokens they hold 0.36B and 1.3B parameters
QWEN2_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2),
}

#: a chat template the character tokenizer can render (its alphabet holds every character):
#: ``<s>`` then per message the role's initial, ``:``, the content and ``>`` (an assistant turn
#: ends in ``</s>`` instead); the generation prompt is ``a:``, and ``a:==`` when the template
#: variable ``enable_thinking`` is false (as templates with thinking turns open an empty one)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% if enable_thinking is defined and not enable_thinking %}=={% endif %}"
    "{% endif %}"
)


def add_chat_template(path: str | Path, template: str = CHAT_TEMPLATE) -> None:
    """Give the tokenizer saved at ``path`` the chat ``template`` (default :data:`CHAT_TEMPLATE`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A ``PreTrainedTokenizerFast`` with one token per character; ids 0..3 are pad, bos, eos, unk.
    Encoding with special tokens prepends ``<s>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def build_tiny_model(
    path: str | Path,
    *,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int = 0,
    architecture: str = "llama",
    num_kv_heads: int | None = None,
    tie_word_embeddings: bool = False,
    num_experts: int = 8,
    top_k: int = 2,
    router_std: float = 1.0,
    expert_std: float = 0.1,
) -> Path:
    """Write a random-weight model (``architecture``: ``llama``, ``qwen3_moe`` or ``qwen2``, which adds biases to
    the q/k/v projections) and its char tokenizer to ``path``; return ``path``. ``num_kv_heads``
    (default ``num_heads``) below ``num_heads`` gives grouped-query attention; ``tie_word_embeddings``
    shares the output layer with the input embeddings.

    ``qwen3_moe``: every layer's MLP is a sparse block of ``num_experts`` experts (each of
    ``intermediate_size // top_k`` hidden units, so a token's MLP has about the dense width), of which
    each token uses its ``top_k``; the routers' weights are drawn with standard deviation
    ``router_std`` (larger than the default initialiser's, so routes are decided by clear margins
    and a token's experts differ from its neighbours'), the experts' weights with ``expert_std``
    (five times the default, so which experts a token goes to visibly moves its log-probs).

    With ``qwen2``, ``AutoTokenizer`` loads the tokenizer as ``Qwen2Tokenizer``, whose byte-level
    pre-tokenizer drops spaces: use an ``alphabet`` without spaces there."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from core_rl.roles.hf import save_pretrained

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"architecture must be one of {', '.join(classes)}, got {architecture!r}")
    config_cls, model_cls = classes[architecture]

    path = Path(path)
    tokenizer = build_char_tokenizer(alphabet)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **(_moe_arguments(num_experts, top_k, intermediate_size) if architecture == "qwen3_moe" else {}),
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    if architecture == "qwen3_moe":
        from core_rl_train_kit.moe import find_routers

        with torch.no_grad():
            for router in find_routers(model):
                router.weight.normal_(0.0, router_std)
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.normal_(0.0, expert_std)
                layer.mlp.experts.down_proj.normal_(0.0, expert_std)
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, path)
    tokenizer.save_pretrained(path)
    return path


def _moe_arguments(num_experts: int, top_k: int, intermediate_size: int) -> dict[str, object]:
    """The ``Qwen3MoeConfig`` arguments of a tiny MoE: every layer sparse, ``top_k`` of
    ``num_experts`` experts of ``intermediate_size // top_k`` units, top-k weights normalised, the
    router's auxiliary loss off by default (the train engine's ``router_aux_loss_coef`` sets it)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=max(1, intermediate_size // top_k),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    data: str | Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    work_dir: str | Path | None = None,
    data_options: dict[str, Any] | None = None,
) -> float:
    """Supervised warm start of a (tiny) model before RL: ``steps`` steps of ``batch_size`` rows of
    ``data`` (a JSONL of ``{"prompt": ..., "response": ...}``) through core-rl's ``sft`` loop (the
    ``core-rl-sft`` plugin: next-token loss on the response), AdamW at ``lr``; the exported model is
    copied to ``out_dir``. Returns the last step's ``sft/loss``. The run itself (its config, metrics
    and export) goes to ``work_dir`` (default ``out_dir``'s parent), as run ``warm_start``.
    ``data_options``: more keys of the run's ``data`` section (e.g. ``apply_chat_template: true``
    for rows with images).

    A random tiny model rarely samples a well-formed answer, so an RL run from it sees no reward; a
    few hundred rows of the answer's format first give GRPO something to compare."""
    import json
    import shutil

    from core_rl.builtin.loggers import read_metrics
    from core_rl.config.loader import load_config
    from core_rl.loops import train
    from core_rl.plugins.host import PluginHost

    out = Path(out_dir)
    root = Path(work_dir) if work_dir is not None else out.parent
    root.mkdir(parents=True, exist_ok=True)
    config = root / "warm_start.yaml"
    config.write_text(
        json.dumps(
            {
                "experiment": {"name": "warm_start", "output_dir": str(root), "seed": seed},
                "data": {"train_files": [str(data)], "batch_size": batch_size, **(data_options or {})},
                "actor": {"model_path": str(model_dir), "optimizer": {"name": "adamw", "lr": lr}},
                "algorithm": {"name": "sft"},
                "trainer": {"total_steps": steps, "torch_threads": 1},
                "saver": {"every_n_steps": 0, "at_end": False},
                "loggers": [],
            }
        )
    )
    host = PluginHost()
    result = train(load_config(config, host=host), host=host)
    shutil.copytree(result["export"], out, dirs_exist_ok=True)
    return float(read_metrics(result["metrics"])[-1]["sft/loss"])
