"""Weight loading: in-memory state dicts (strict names, tied weights) and Hugging Face directories."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf.engine import HFRolloutEngine
from core_rl_hf.weights import load_full_state_dict, read_safetensors_dir, safetensors_files

MakeEngine = Callable[..., HFRolloutEngine]
PROMPTS = [[1, 10, 11, 12], [1, 20]]


def _perturbed(state_dict: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state_dict.items()}


def _assert_model_holds(engine: HFRolloutEngine, state_dict: dict[str, torch.Tensor]) -> None:
    own = engine.model.state_dict()
    for key, value in state_dict.items():
        torch.testing.assert_close(own[key], value.to(own[key].dtype), atol=0, rtol=0)


def test_weight_version_starts_at_zero_and_follows_updates(
    make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    engine = make_engine()
    assert engine.weight_version == 0
    assert all(s.weight_version == 0 for g in engine.generate(PROMPTS, SamplingParams(max_new_tokens=2)) for s in g)
    new = _perturbed(tiny_state_dict)
    engine.update_weights(new, version=5)
    assert engine.weight_version == 5
    _assert_model_holds(engine, new)


def test_update_weights_rejects_missing_unexpected_and_misshapen(
    make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    engine = make_engine()
    missing = {k: v for k, v in tiny_state_dict.items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match=r"missing model\.norm\.weight, unexpected none"):
        engine.update_weights(missing, version=1)
    with pytest.raises(KeyError, match="unexpected extra.weight"):
        engine.update_weights({**tiny_state_dict, "extra.weight": torch.zeros(1)}, version=1)
    wrong = {**tiny_state_dict, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight: \(3,\)"):
        engine.update_weights(wrong, version=1)
    assert engine.weight_version == 0
    _assert_model_holds(engine, tiny_state_dict)  # a rejected update changes nothing


def _buckets(state_dict: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    keys = list(state_dict)
    return [{k: state_dict[k] for k in keys[i::count]} for i in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_weights_from_buckets_copies_in_place(
    make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor], dtype: str
) -> None:
    engine = make_engine(dtype=dtype)
    storage = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    new = _perturbed(tiny_state_dict)
    engine.update_weights_from_buckets(iter(_buckets(new, 3)), version=4)
    assert engine.weight_version == 4
    _assert_model_holds(engine, new)  # bit-exact in float32, rounded once to bfloat16
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == storage  # copied into its own tensors
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert all(s.weight_version == 4 for group in out for s in group)


def test_update_weights_from_buckets_refuses_a_bad_bucket_whole_and_a_missing_key_at_the_end(
    make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    engine = make_engine()
    first, second = _buckets(_perturbed(tiny_state_dict), 2)
    bad = {**second, "model.norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight: \(3,\)"):
        engine.update_weights_from_buckets([first, bad], version=1)
    _assert_model_holds(engine, first)  # the first bucket landed
    held = {k: engine.model.state_dict()[k].clone() for k in second}
    _assert_model_holds(engine, held)
    with pytest.raises(KeyError, match="unexpected extra.weight"):
        engine.update_weights_from_buckets([{**second, "extra.weight": torch.zeros(1)}], version=1)
    _assert_model_holds(engine, held)  # nothing of the refused bucket was copied
    with pytest.raises(KeyError, match=r"missing .*unexpected none"):
        engine.update_weights_from_buckets([first], version=1)
    assert engine.weight_version == 0


def test_tied_weights_may_be_left_out(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=20,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    new = _perturbed(model.state_dict())
    del new["lm_head.weight"]
    load_full_state_dict(model, new)
    torch.testing.assert_close(model.lm_head.weight, new["model.embed_tokens.weight"], atol=0, rtol=0)


def test_load_weights_from_sharded_directory(
    make_engine: MakeEngine, tiny_model_path: Path, tiny_state_dict: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    new = _perturbed(tiny_state_dict, seed=1)
    model.load_state_dict(new)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = safetensors_files(tmp_path / "sharded")
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert set(read_safetensors_dir(tmp_path / "sharded")) == set(tiny_state_dict)

    engine = make_engine()
    engine.load_weights_from_path(tmp_path / "sharded", version=2)
    assert engine.weight_version == 2
    _assert_model_holds(engine, new)
    engine.load_weights_from_path(tiny_model_path, version=3)
    _assert_model_holds(engine, tiny_state_dict)


def test_load_weights_from_directory_without_weights(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = make_engine()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        engine.load_weights_from_path(tmp_path, version=1)
    assert engine.weight_version == 0


def test_weights_only_directory_without_tokenizer(tiny_model_path: Path, tmp_path: Path) -> None:
    from core_rl_hf.config import HFRolloutConfig
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "bare")
    engine = HFRolloutEngine(tmp_path / "bare", HFRolloutConfig(device="cpu"))
    assert engine.eos_token_ids == [2] and engine.pad_token_id == 0
    engine.close()
