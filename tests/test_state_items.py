"""``core_rl.sync.buckets.state_items``: ``state_dict()``'s entries without its hooks, in a
weight sync every step. Same names and the same storage as ``state_dict()``, for a model with tied
weights, persistent and non-persistent buffers, LoRA adapters, and an FSDP-wrapped one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.sync.buckets import state_items
from torch import nn


def _same_as_state_dict(module: nn.Module) -> None:
    got = list(state_items(module))  # first: state_dict()'s own hooks may change what the module holds
    want = module.state_dict()
    assert [name for name, _ in got] and sorted(name for name, _ in got) == sorted(want)
    assert len(got) == len(want)  # each name once
    for name, tensor in got:
        assert _storage(tensor) == _storage(want[name]), name  # the tensor itself, no copy


def _storage(tensor: torch.Tensor) -> int:
    """Where the elements are (a DTensor's own ``data_ptr`` is 0: its local shard's)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local().data_ptr() if isinstance(tensor, DTensor) else tensor.data_ptr()


class _Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 2)
        self.register_buffer("kept", torch.ones(2))
        self.register_buffer("dropped", torch.zeros(2), persistent=False)
        self.register_buffer("unset", None)
        self.head = nn.Linear(2, 3, bias=False)
        self.tail = self.inner  # one module under two names


def test_buffers_and_a_module_under_two_names() -> None:
    module = _Buffers()
    _same_as_state_dict(module)
    names = [name for name, _ in state_items(module)]
    assert "kept" in names and "dropped" not in names and "unset" not in names
    assert {"inner.weight", "tail.weight"} <= set(names)


def test_a_tied_model_and_its_lora_wrapping(tmp_path: Path) -> None:
    from core_rl.testing.tiny import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "model", seed=0, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    _same_as_state_dict(model)  # lm_head.weight and model.embed_tokens.weight: one tensor, both names
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    _same_as_state_dict(wrapped)
    assert any("lora_A" in name for name, _ in state_items(wrapped))


def test_an_fsdp_wrapped_model_after_reshard(tmp_path: Path) -> None:
    """FSDP2's sharded parameters (DTensors on a one-rank mesh) once resharded, as ``state_dict()``'s
    pre-hook would leave them."""
    pytest.importorskip("core_rl_fsdp")
    from core_rl.config.schema import ActorConfig, OptimizerConfig, PluginSpec
    from core_rl.testing.tiny import build_tiny_model
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine
    from core_rl_fsdp.model import FSDPModule
    from torch.distributed.tensor import DTensor

    path = build_tiny_model(tmp_path / "model", seed=0)
    actor = ActorConfig(model_path=str(path), engine=PluginSpec(name="fsdp"), optimizer=OptimizerConfig(name="adamw"))
    engine = FSDPEngine(actor, FSDPConfig(device="cpu", param_dtype="bfloat16", reduce_dtype="float32"))
    assert isinstance(engine.model, FSDPModule)
    with torch.no_grad():
        engine.model(torch.tensor([[1, 2, 3]]))  # FSDP's lazy initialisation (its state-dict hooks)
    engine.model.unshard()  # the parameters unsharded and registered (bfloat16 copies)
    for module in engine.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    _same_as_state_dict(engine.model)
    assert all(isinstance(t, DTensor) for name, t in state_items(engine.model) if name.endswith("weight"))
    engine.close()
