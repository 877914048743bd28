"""LoRA adapters through peft, for any train engine: wrap a model, turn a full state dict of the
wrapped model into merged weights with the base model's Hugging Face names (what rollout engines
and exports need), and write the adapter alone in peft's ``save_pretrained`` format.

Names in a peft-wrapped model's state dict (adapter ``default``)::

    base_model.model.<path>.base_layer.weight      the frozen base weight W  [out, in]
    base_model.model.<path>.lora_A.default.weight  A                          [r, in]
    base_model.model.<path>.lora_B.default.weight  B                          [out, r]
    base_model.model.<other>                       everything not adapted

Merged: ``<path>.weight = W + scaling * B @ A`` with ``scaling = alpha / r`` (``alpha / sqrt(r)``
with rank-stabilised LoRA), ``W`` transposed first for layers stored ``fan_in_fan_out``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from torch import nn

from core_rl import checkpointing as ckpt
from core_rl.config.schema import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError(
            "actor.lora.rank > 0 needs peft, which is not installed; install it with: pip install peft"
        ) from None
    return peft


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters on ``config.target_modules`` (the base weights
    frozen, only the adapters trainable); ``B`` starts at zero, so the wrapped model computes
    exactly what ``model`` did."""
    peft = _peft()
    targets: str | list[str] = config.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as exc:  # e.g. no module matches target_modules
        raise ValueError(f"actor.lora.target_modules: {exc}") from None


def is_lora_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and ADAPTER in getattr(model, "peft_config", {})


def lora_scaling(model: nn.Module) -> float:
    """``alpha / r`` (or ``alpha / sqrt(r)`` with rank-stabilised LoRA) of the model's adapter."""
    config = model.peft_config[ADAPTER]
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def merged_state_dict(
    state: dict[str, torch.Tensor], *, scaling: float, fan_in_fan_out: bool = False
) -> dict[str, torch.Tensor]:
    """The base model's state dict (Hugging Face names) with every adapted weight merged (see the
    module docstring), from the full state dict of the peft-wrapped model. Pure: ``state`` is not
    modified; merged weights keep the base weight's dtype (the product is taken in float32)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".lora_embedding_" in name:
            raise ValueError(f"{name}: merging LoRA adapters on embeddings is not supported; adapt linear layers only")
        if ".lora_A." in name or ".lora_B." in name:
            continue
        plain = name.removeprefix(PEFT_PREFIX)
        if ".base_layer." in plain:
            module = plain.split(".base_layer.")[0]
            plain = plain.replace(".base_layer.", ".")
            a_name = f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight"
            b_name = f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight"
            if plain.endswith(".weight") and a_name in state:
                delta = (state[b_name].float() @ state[a_name].float()) * scaling
                if fan_in_fan_out:
                    delta = delta.T
                value = (value.float() + delta).to(value.dtype)
        out[plain] = value
    return out


def hf_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face-named weights from ``model``'s full state dict ``state``: merged
    (:func:`merged_state_dict`) when ``model`` carries LoRA adapters, ``state`` itself otherwise."""
    if not state or not is_lora_model(model):
        return state
    fan_in_fan_out = bool(model.peft_config[ADAPTER].fan_in_fan_out)
    return merged_state_dict(state, scaling=lora_scaling(model), fan_in_fan_out=fan_in_fan_out)


def adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's weights from the wrapped model's full state dict, named as peft saves them."""
    return _peft().get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER)


def write_adapter_dir(final: Path, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Write the adapter alone to ``final`` (``adapter_config.json`` + ``adapter_model.safetensors``,
    loadable by ``peft.PeftModel.from_pretrained(base, final)``), via a partial directory moved into
    place (:mod:`core_rl.checkpointing`)."""
    from safetensors.torch import save_file

    weights = {k: v.contiguous() for k, v in adapter_state_dict(model, state).items()}
    tmp = ckpt.prepare_partial(final)
    try:
        model.peft_config[ADAPTER].save_pretrained(str(tmp))
        config_file = tmp / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["base_model_name_or_path"] = config.get("base_model_name_or_path") or ""
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(weights, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt.commit_partial(final)


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (``model`` itself if it is not wrapped): its
    config and ``save_pretrained`` write a plain model directory."""
    return model.get_base_model() if is_lora_model(model) else model
