"""Each training capability once on the real pretrained model (SmolLM2-135M-Instruct, ``real_model``:
a BPE vocabulary, the ChatML template, an output head tied to the embedding), through ``core-rl
train``: SFT, DPO, a reward model, PPO with a critic on the real backbone, LoRA and asynchronous
GRPO. Each run is short (1 or 2 steps of 2 prompts x 2 samples of at most 8 new tokens, or of 4
rows; no checkpoint or export unless checked) and checked for what would be wrong if the capability
were wrong on this model, not only that it ends:

- SFT: the step-1 loss is the model's own NLL of ``response + <|im_end|>`` after the chat-rendered
  prompt, recomputed here with transformers (so the loss mask covers exactly the response tokens of
  the rendered prompt), the target-token count is theirs, and the loss falls on the same rows;
- DPO: ``ln 2`` at step 1 (policy = reference), the chosen and rejected log-probs are the
  recomputed ones, and the second step on the same pairs has a positive margin;
- RM: ``ln 2`` at step 1 (the score head starts at zero), lower after the update on the same
  (held-out) pairs, and the export reloads as ``AutoModelForSequenceClassification`` (no
  ``lm_head``, no weight missing or left over) scoring those pairs as the run did;
- PPO: the critic's checkpoint loads strictly into ``AutoModelForTokenClassification``: the real
  backbone (unchanged by a first step, whose gradient stops at the zero head) and a trained score
  head, giving finite, non-zero values;
- LoRA: the adapter is exported, targets every linear layer but neither the embedding nor the tied
  head, and the merged export is the base plus the adapter's ``(alpha / r) B A``, its head still tied
  to the untouched embedding;
- async: every sample within ``max_head_offpolicyness`` 1, step 2's one version behind, and the
  update's first pass then sees a KL between behaviour and current policy (the previous weights'
  samples) where step 1 saw none.

The figures of these runs (s/step, peak memory) are in docs/real-models.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from real_model_helpers import chat_prompt, load_model, response_ids, response_logprobs, rl_sections, train, write_tasks

for _dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo"):
    pytest.importorskip(_dist)

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The addition task, its pairs and its SFT rows (:func:`real_model_helpers.write_tasks`)."""
    return write_tasks(tmp_path_factory.mktemp("real_data"))


@pytest.fixture(scope="module")
def hf(real_model: Path) -> dict[str, Any]:
    """The real model's tokenizer and causal LM in this process, for recomputing what the runs report."""
    return load_model(real_model)


def supervised_sections(model: Path, files: Path, algorithm: str, **trainer: Any) -> dict[str, Any]:
    """The ``algorithm`` loop on the 4 rows of ``files``, all of them each step, the chat template."""
    return {
        "data": {"train_files": [str(files)], "batch_size": 4, "apply_chat_template": True},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-5}},
        "algorithm": {"name": algorithm},
        "trainer": trainer,
    }


# -- the capabilities --------------------------------------------------------------------------


def test_sft(tmp_path: Path, real_model: Path, data: dict, hf: dict) -> None:
    pytest.importorskip("core_rl_sft")
    _, rows = train(
        tmp_path, "sft", supervised_sections(real_model, data["sft"], "sft", loop={"response_key": "response"})
    )
    tok, model = hf["tokenizer"], hf["model"]
    nll, targets = 0.0, 0
    for row in data["sft_rows"]:
        response = response_ids(tok, row["response"], eos=True)  # the digits, then <|im_end|>
        nll -= float(response_logprobs(model, chat_prompt(tok, row["prompt"]), response).sum())
        targets += len(response)
    # the mask holds the response tokens alone (no prompt, template or padding token)
    assert [r["sft/target_tokens"] for r in rows] == [targets, targets]
    # and the loss is the token-mean NLL of exactly those tokens after the rendered prompt
    assert rows[0]["sft/loss"] == pytest.approx(nll / targets, rel=1e-4)
    assert rows[1]["sft/loss"] < rows[0]["sft/loss"]  # the same rows, after one update
    assert rows[0]["actor/grad_norm"] > 0


def test_dpo(tmp_path: Path, real_model: Path, data: dict, hf: dict) -> None:
    pytest.importorskip("core_rl_dpo")
    _, rows = train(tmp_path, "dpo", supervised_sections(real_model, data["pairs"], "dpo"))
    first, second = rows
    # step 1: the policy is its reference, every log-ratio 0
    assert first["dpo/loss"] == pytest.approx(LN2, abs=1e-5)
    assert first["dpo/rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    tok, model = hf["tokenizer"], hf["model"]
    for key in ("chosen", "rejected"):  # the mean over pairs of each response's summed log-prob (with EOS)
        logps = [
            float(response_logprobs(model, chat_prompt(tok, r["prompt"]), response_ids(tok, r[key], eos=True)).sum())
            for r in data["pair_rows"]
        ]
        assert first[f"dpo/logps/{key}"] == pytest.approx(sum(logps) / len(logps), rel=1e-4), key
    # step 2, the same pairs: the chosen answers gained on the rejected ones
    assert second["dpo/rewards/margin"] > 0 and second["dpo/loss"] < LN2
    assert first["actor/grad_norm"] > 0


def test_reward_model(tmp_path: Path, real_model: Path, data: dict, hf: dict) -> None:
    pytest.importorskip("core_rl_rm")
    import torch
    from transformers import AutoModelForSequenceClassification

    loop = {"val_files": [str(data["pairs"])]}  # scored after the last step, with the final weights
    run, (row,) = train(
        tmp_path, "rm", supervised_sections(real_model, data["pairs"], "rm", loop=loop), steps=1, export=True
    )
    # step 1: the score head starts at zero, so every score is 0 and the loss ln 2
    assert row["rm/loss"] == pytest.approx(LN2, abs=1e-6)
    assert row["rm/scores/chosen"] == 0.0 and row["rm/scores/rejected"] == 0.0
    assert row["actor/grad_norm"] > 0
    assert row["rm/val/loss"] < LN2 and row["rm/val/scores/margin"] > 0  # the same pairs, after the update

    export = run / "final_hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    model, info = AutoModelForSequenceClassification.from_pretrained(
        export, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not hasattr(model, "lm_head") and model.score.weight.abs().max() > 0
    tok = hf["tokenizer"]
    scores: dict[str, list[float]] = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for pair in data["pair_rows"]:
            for key in scores:  # no EOS: the score is read at the response's own last token
                ids = chat_prompt(tok, pair["prompt"]) + response_ids(tok, pair[key], eos=False)
                scores[key].append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    for key, values in scores.items():  # the export scores as the run's final weights did
        assert sum(values) / len(values) == pytest.approx(row[f"rm/val/scores/{key}"], rel=1e-4, abs=1e-5), key


def test_ppo_with_a_critic(tmp_path: Path, real_model: Path, data: dict, hf: dict) -> None:
    """One step: the critic's checkpoint after it holds what the step trained."""
    pytest.importorskip("core_rl_ppo")
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    critic = {"model_path": str(real_model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-5}}
    sections = rl_sections(real_model, data, algorithm={"name": "ppo"}, critic=critic)
    sections["saver"] = {"save_optimizer": False}  # the weights alone: 1 GB less to write
    run, (row,) = train(tmp_path, "ppo", sections, steps=1, checkpoint=True)
    assert row["critic/values_mean"] == 0.0  # the value head starts at zero
    assert row["critic/loss"] > 0 and row["critic/grad_norm"] > 0 and row["actor/grad_norm"] > 0

    saved = run / "checkpoints" / "step_00000001" / "critic"
    assert json.loads((saved / "meta.json").read_text())["head"] == "value"
    # the critic's weights are a token classifier of the real backbone: they load into one with no
    # weight missing or left over (a directory of the model's config as such, and the weights)
    as_hf = tmp_path / "critic_hf"
    AutoConfig.from_pretrained(real_model, num_labels=1, architectures=["LlamaForTokenClassification"]).save_pretrained(
        as_hf
    )
    (as_hf / "model.safetensors").symlink_to(saved / "model.safetensors")
    model, info = AutoModelForTokenClassification.from_pretrained(as_hf, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    model.eval()
    assert model.score.weight.abs().max() > 0  # trained from zero
    # its backbone is the real model's: unchanged by this first step, since with the head at zero the
    # loss has no gradient below the head (a randomly initialised or wrongly loaded one would differ)
    base = hf["model"].model.state_dict()
    backbone = model.model.state_dict()
    assert backbone.keys() == base.keys() and all(torch.equal(v, base[k]) for k, v in backbone.items())
    tok = hf["tokenizer"]
    ids = chat_prompt(tok, data["sft_rows"][0]["prompt"]) + response_ids(tok, "122", eos=True)
    with torch.no_grad():
        values = model(input_ids=torch.tensor([ids])).logits[0, :, 0]
    assert torch.isfinite(values).all() and values.abs().max() > 0


def test_lora(tmp_path: Path, real_model: Path, data: dict, hf: dict) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = {"lora": {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}}
    run, (row,) = train(tmp_path, "lora", rl_sections(real_model, data, lr=1e-4, actor=lora), steps=1, export=True)
    assert row["actor/grad_norm"] > 0
    adapter = run / "final_hf" / "adapter"
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    targets = set(adapter_config["target_modules"])
    linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert targets == linear, targets  # every linear layer, but not the head tied to the embedding
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert not any("lm_head" in k or "embed_tokens" in k for k in weights)
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all(v.abs().max() > 0 for v in lora_b.values())  # all trained from zero

    merged = AutoModelForCausalLM.from_pretrained(run / "final_hf", dtype=torch.float32)
    assert merged.config.tie_word_embeddings
    assert merged.lm_head.weight.data_ptr() == merged.get_input_embeddings().weight.data_ptr()
    assert "lm_head.weight" not in load_file(str(run / "final_hf" / "model.safetensors"))
    base = hf["model"]
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)  # frozen
    # the merged weights are the base's plus the adapter's (alpha / r) B A
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    for layer in (0, 29):
        for module in ("self_attn.q_proj", "mlp.down_proj"):
            prefix = next(k for k in lora_b if f"layers.{layer}.{module}.lora_B" in k).rsplit(".lora_B", 1)[0]
            delta = scale * weights[f"{prefix}.lora_B.weight"] @ weights[f"{prefix}.lora_A.weight"]
            name = f"model.layers.{layer}.{module}.weight"
            merged_w, base_w = merged.get_parameter(name), base.get_parameter(name)
            assert not torch.equal(merged_w, base_w), name
            torch.testing.assert_close(merged_w, base_w + delta, rtol=0, atol=1e-6)


def test_async(tmp_path: Path, real_model: Path, data: dict) -> None:
    sections = rl_sections(real_model, data, rollout={"controller": {"max_head_offpolicyness": 1}})
    _, rows = train(tmp_path, "async", sections)
    for row in rows:
        assert row["async/max_head_offpolicyness"] == 1.0
        assert 0.0 <= row["staleness/max"] <= 1.0
        assert sum(row.get(f"staleness/hist_{k}", 0.0) for k in range(2)) == pytest.approx(1.0)
    first, second = rows
    assert first["staleness/max"] == 0.0 and first["actor/grad_norm"] > 0
    # step 2 trains on samples generated while step 1 trained: one version behind. The update's
    # first pass compares the current policy with the behaviour log-probs: at step 1 they are the
    # same weights' (the hf engine in float32: 5e-12 measured), at step 2 the previous weights' (4e-3)
    assert second["staleness/max"] == 1.0
    assert first["actor/approx_kl"] < 1e-8
    assert second["actor/approx_kl"] > 1e-6, second["actor/approx_kl"]
