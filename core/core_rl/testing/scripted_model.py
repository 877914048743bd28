"""A real tiny Llama whose weights script what it samples: for tests that need a model to write a
given text (a tool call, a judge's verdict) through a real engine, sampler, proxy or server.

The tokenizer is core-rl's character tokenizer over printable ASCII plus a few added tokens (whole
words, as a real vocabulary has). The model's attention and MLP outputs are zeroed, so its hidden
state at a position is its token's embedding, one-hot: the next token depends on the current token
alone, through a successor table written into the output layer with a margin that makes it
certain (log-prob 0 up to float rounding). Each ``chains`` entry ``trigger -> [t1, ..., tk]``
makes a prompt ending in character ``trigger`` be answered ``t1 ... tk </s>``; every other token is
followed by ``</s>``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path

#: printable ASCII without the whitespace the character tokenizer does not split
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " "
#: logit of the scripted next token (the hidden state is normalised to norm sqrt(hidden_size))
MARGIN = 5.0


def build_scripted_model(
    path: Path, chains: Mapping[str, Sequence[str]], hidden_size: int = 128, chat_template: str | None = None
) -> Path:
    """Write the model and tokenizer to ``path`` (see the module docstring), the tokenizer with
    ``chat_template`` when given (for servers that render chat requests themselves); return ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core_rl.roles.hf import save_pretrained
    from core_rl.testing.tiny import build_tiny_model

    build_tiny_model(path, alphabet=ALPHABET, hidden_size=hidden_size, num_layers=1, max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(list(dict.fromkeys(t for chain in chains.values() for t in chain if len(t) > 1)))
    vocab = len(tokenizer)
    if vocab > hidden_size:
        raise ValueError(f"{vocab} tokens need hidden_size >= {vocab}")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(vocab)
    successor = dict.fromkeys(range(vocab), tokenizer.eos_token_id)
    for trigger, chain in chains.items():
        ids = [tokenizer.convert_tokens_to_ids(t) for t in (trigger, *chain)]
        if tokenizer.unk_token_id in ids or len(set(ids)) != len(ids):
            raise ValueError(f"chain {trigger!r}: {chain!r} needs distinct tokens of the vocabulary")
        successor.update(zip(ids, [*ids[1:], tokenizer.eos_token_id]))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden_size))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden_size)
        for current, following in successor.items():
            head[following, current] = MARGIN
        model.lm_head.weight.copy_(head)
    save_pretrained(model, path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path
