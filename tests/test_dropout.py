"""``actor.disable_dropout`` (:func:`core_rl.roles.hf.disable_dropout`): a model whose config
asks for attention dropout trains without it by default (two training-mode forwards agree, and agree
with eval mode, as rollout and reference run), keeps it with ``disable_dropout: false``, and LoRA's
own dropout is left alone; then through the fsdp engine, a train step's log-probs are the eval ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.config.model_sections import LoraConfig
from core_rl.config.schema import ActorConfig
from core_rl.roles.hf import disable_dropout, load_causal_lm, prepare_for_role
from core_rl.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose config sets attention dropout 0.5 (applied inside the attention kernel)."""
    path = build_tiny_model(tmp_path_factory.mktemp("dropout") / "m", alphabet="abc", hidden_size=32, num_heads=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    return path


def _train_forwards(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[1, 4, 5, 6, 4, 5, 6, 4]])
    model.train()
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.eval()
        evaluated = model(input_ids=ids).logits
    return first, second, evaluated


def test_a_trained_model_has_no_dropout_by_default(dropout_model: Path) -> None:
    torch.manual_seed(0)
    kept = prepare_for_role(
        load_causal_lm(str(dropout_model), dtype="float32"), ActorConfig(disable_dropout=False), trainable=True
    )
    first, second, evaluated = _train_forwards(kept)
    assert not torch.equal(first, second)  # the model's own dropout, as its config asks
    model = load_causal_lm(str(dropout_model), dtype="float32")
    prepared = prepare_for_role(model, ActorConfig(), trainable=True)
    first, second, evaluated = _train_forwards(prepared)
    assert torch.equal(first, second) and torch.equal(first, evaluated)
    assert model.config.attention_dropout == 0.0  # what a forward reading the config sees, and an export


def test_every_kind_of_dropout_is_counted_and_loras_own_stays(dropout_model: Path) -> None:
    model = load_causal_lm(str(dropout_model), dtype="float32")
    model.extra = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Dropout2d(0.2), torch.nn.Dropout(0.0))
    layers = model.config.num_hidden_layers
    assert disable_dropout(model) == 1 + layers + 2  # the config's, each layer's attention, two modules
    assert disable_dropout(model) == 0
    lora = ActorConfig(lora=LoraConfig(rank=4, alpha=8, dropout=0.3, target_modules=["q_proj"]))
    wrapped = prepare_for_role(load_causal_lm(str(dropout_model), dtype="float32"), lora, trainable=True)
    probabilities = {m.p for name, m in wrapped.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert probabilities == {0.3}  # only LoRA's dropout modules remain, at their setting


pytest.importorskip("core_rl_fsdp")


def test_an_engines_train_step_reads_the_eval_log_probs(dropout_model: Path) -> None:
    """The fsdp engine built from the section: the log-probs its train step computes (train mode)
    equal those of ``compute_logprobs`` (eval mode), as the rollout's and reference's are; with
    ``disable_dropout: false`` they do not."""
    from core_rl.config.schema import PluginSpec
    from core_rl.interfaces import LossOutput
    from core_rl.testing.helpers import make_rl_batch
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine

    batch = make_rl_batch(vocab_size=7, seed=1)
    for disabled in (True, False):
        actor = ActorConfig(model_path=str(dropout_model), engine=PluginSpec(name="fsdp"), disable_dropout=disabled)
        engine = FSDPEngine(actor, FSDPConfig(), trainable=True)
        before = engine.compute_logprobs(batch)
        seen: list[torch.Tensor] = []

        def loss(b, logprobs, entropy, seen=seen):
            seen.append(logprobs.detach()[b["response_mask"] != 0].cpu())  # the engine's device
            return LossOutput(per_token_loss=0.0 * logprobs)

        batch["loss_weight"] = batch["loss_mask"] / batch["loss_mask"].sum()
        engine.train_step(batch, loss)
        trained = torch.sort(torch.cat(seen)).values
        evaluated = torch.sort(before[batch["response_mask"] != 0]).values
        assert trained.shape == evaluated.shape
        gap = (trained - evaluated).abs().max().item()
        assert gap < 1e-5 if disabled else gap > 1e-2, gap
