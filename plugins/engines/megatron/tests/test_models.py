"""Each supported family built as a Megatron model on one rank (CPU): the loaded weights gather back
to the Hugging Face ones bit for bit, and logits and log-probs equal the Hugging Face model's.

Tiny random models: Llama (the char-tokenizer test model; and with Llama-3 rope scaling and grouped
-query attention), Qwen2 (q/k/v biases, grouped-query attention, tied embeddings) and Qwen3 (per-head
q/k norms, head_dim != hidden / heads, grouped-query attention)."""

from __future__ import annotations

from pathlib import Path

import mcore_common as common
import pytest
import torch
from core_rl.config.schema import ActorConfig, PluginSpec
from core_rl.testing import make_rl_batch
from core_rl.testing.contracts import hf_logprobs
from core_rl.testing.tiny import build_char_tokenizer
from core_rl_megatron.config import MegatronConfig
from core_rl_megatron.engine import MegatronEngine
from core_rl_megatron.errors import MegatronSetupError
from mcore_common import LLAMA3_ROPE

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


def build(kind: str, path: Path) -> Path:
    """A random-weight model of family ``kind`` with the char tokenizer, saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_char_tokenizer()
    ids = {"vocab_size": len(tokenizer) + 3, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(3)
    if kind == "llama3_gqa":
        # max_position_embeddings above the rope's original 8192, as real Llama-3 configs have
        config = LlamaConfig(
            **{**SMALL, "max_position_embeddings": 16384}, **ids, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen2_tied_gqa":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, **ids, num_key_value_heads=2, tie_word_embeddings=True))
    elif kind == "qwen3_gqa":
        model = Qwen3ForCausalLM(
            Qwen3Config(**SMALL, **ids, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)
        )
    else:
        raise AssertionError(kind)
    # the tiny models' norms start at 1; random ones make the norm mapping matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["tiny_llama", "llama3_gqa", "qwen2_tied_gqa", "qwen3_gqa"])
def model_dir(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "tiny_llama":
        return tiny_model
    return build(request.param, tmp_path_factory.mktemp(request.param) / "model")


def frozen(path: Path, **options: object) -> MegatronEngine:
    actor = ActorConfig(model_path=str(path), engine=PluginSpec(name="megatron"))
    return MegatronEngine(actor, MegatronConfig(make_vocab_size_divisible_by=8, **options), trainable=False)


def test_round_trip_logits_and_logprobs(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = frozen(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = engine.full_state_dict()
    want = hf_model.state_dict()
    assert state.keys() == want.keys()
    for key in want:
        assert torch.equal(state[key], want[key]), key

    batch = make_rl_batch(batch_size=5, vocab_size=40, seed=4)
    logits = common.full_logits(engine, batch).cpu()
    ref = common.hf_logits(str(model_dir), batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], ref[real], atol=1e-4, rtol=0)
    assert common.mean_nll(logits, batch) == pytest.approx(common.mean_nll(ref, batch), rel=1e-6)
    for temperature in (1.0, 0.6):
        got = engine.compute_logprobs(batch, temperature=temperature)
        lp = hf_logprobs(model_dir, batch["input_ids"], batch["attention_mask"], temperature)
        torch.testing.assert_close(got, lp, atol=1e-5, rtol=0)
    engine.close()


def test_export_of_a_tied_model_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = build("qwen2_tied_gqa", tmp_path / "qwen2")
    engine = frozen(path)
    engine.export_hf(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.model_type == "qwen2"
    batch = make_rl_batch(batch_size=3, vocab_size=40, seed=5)
    want = hf_logprobs(tmp_path / "export", batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(engine.compute_logprobs(batch), want, atol=1e-5, rtol=0)
    engine.close()


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only error: these settings run on a GPU")


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param(
            {"pipeline_model_parallel_size": 2}, "actor.engine.pipeline_model_parallel_size: needs CUDA", marks=CPU_ONLY
        ),
        pytest.param({"bf16": True}, "actor.engine.bf16: needs CUDA", marks=CPU_ONLY),
        pytest.param(
            {"ddp": {"use_distributed_optimizer": True}},
            "actor.engine.ddp.use_distributed_optimizer: needs CUDA",
            marks=CPU_ONLY,
        ),
        ({"expert_model_parallel_size": 2}, "actor.engine.expert_model_parallel_size: 2 needs a mixture-of-experts"),
        ({"tensor_model_parallel_size": 2}, "1 ranks cannot be divided"),
    ],
)
def test_settings_this_machine_cannot_run_are_clear_errors(tiny_model: Path, options: dict, key: str) -> None:
    from core_rl.config.loader import structure

    cfg = structure(options, MegatronConfig, path="actor.engine")
    actor = ActorConfig(model_path=str(tiny_model), engine=PluginSpec(name="megatron"))
    with pytest.raises(MegatronSetupError, match=key.replace("(", r"\(")):
        MegatronEngine(actor, cfg)


def test_a_model_of_another_family_is_a_clear_error(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(MegatronSetupError, match="model family 'gpt2'.*supported: llama, qwen2, qwen3"):
        frozen(tmp_path)
