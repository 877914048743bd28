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

On a vision-language model (its config has a ``vision_config``) the adapters go on its language
model only (the module ``get_decoder()`` returns): :func:`language_model_targets` turns
``target_modules`` into the full names of the language model's modules they name, so the vision
tower and its projector get none and stay frozen with the rest of the base model.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from core_rl.checkpoint import files as ckpt
from core_rl.config.schema import LoraConfig
from core_rl.errors import ConfigError

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


def language_model_targets(model: nn.Module, target_modules: list[str], key: str = "actor.lora") -> list[str] | None:
    """For a vision-language ``model`` (a ``vision_config`` and a language model, ``get_decoder()``),
    the full names of the language model's modules that ``target_modules`` names (a name or a
    ``.``-suffix of one, as peft matches; ``["all-linear"]``: every linear layer), so that nothing of
    the vision tower or projector, nor the output head, is adapted; ``None`` for a text model. Raises
    :class:`ConfigError` naming ``key.target_modules`` when none matches."""
    config = getattr(model, "config", None)
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if getattr(config, "vision_config", None) is None or decoder is None or decoder is model:
        return None
    prefix = next((name for name, module in model.named_modules() if module is decoder), None)
    if not prefix:
        return None
    every_linear = target_modules == ["all-linear"]
    names = []
    for name, module in decoder.named_modules():
        if every_linear:
            chosen = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
        else:
            chosen = any(name == t or name.endswith(f".{t}") for t in target_modules)
        if name and chosen:
            names.append(f"{prefix}.{name}")
    if not names:
        raise ConfigError(
            f"{key}.target_modules: {target_modules}: no module of the language model ({prefix}) matches; on a "
            "vision-language model adapters go on the language model only (name its linear layers, e.g. q_proj "
            "and v_proj, or all-linear)"
        )
    return names


def apply_lora(model: nn.Module, config: LoraConfig, key: str = "actor.lora") -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters on ``config.target_modules`` (the base weights
    frozen, only the adapters trainable); ``B`` starts at zero, so the wrapped model computes
    exactly what ``model`` did. On a vision-language model only its language model's modules get
    adapters (:func:`language_model_targets`). Target modules peft refuses raise
    :class:`ConfigError` naming ``key.target_modules``."""
    peft = _peft()
    targets: str | list[str] = config.target_modules
    language = language_model_targets(model, config.target_modules, key)
    if language is not None:
        targets = language
    elif targets == ["all-linear"]:
        targets = "all-linear"
    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        use_rslora=config.use_rslora,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft reads a transformers property that warns of its rename
            warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
            return peft.get_peft_model(model, lora)
    except ValueError as exc:  # e.g. no module matches target_modules
        raise ConfigError(
            f"{key}.target_modules: {config.target_modules}: peft: {exc} (name the model's linear layers, "
            "e.g. q_proj and v_proj, or all-linear)"
        ) from None


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
    adapted = {_module_of(name, ".lora_A.") for name in state if ".lora_A." in name}
    return dict(merged_items(state.items(), adapted=adapted, scaling=scaling, fan_in_fan_out=fan_in_fan_out))


def adapted_modules(model: nn.Module) -> set[str]:
    """Paths (as in the wrapped model's state dict, without the peft prefix) of the modules of
    ``model`` that carry a LoRA adapter."""
    return {_module_of(name, ".lora_A.") for name, _ in model.named_parameters() if ".lora_A." in name}


def is_adapter_key(name: str) -> bool:
    """Whether ``name`` (in the wrapped model's state dict) is a tensor of the adapter (``A``, ``B``):
    what :func:`write_adapter_dir` writes."""
    return f".{ADAPTER}." in name and (".lora_A." in name or ".lora_B." in name)


def _module_of(name: str, part: str) -> str:
    return name.removeprefix(PEFT_PREFIX).split(part)[0]


def merged_items(
    named: Iterable[tuple[str, torch.Tensor]], *, adapted: set[str], scaling: float, fan_in_fan_out: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict`, drawn lazily from the wrapped model's ``(name, tensor)`` pairs: an
    adapted module's base weight, ``A`` and ``B`` are held only until the last of the three arrives
    (they come one after another in a peft model's order), so at most about one layer is held,
    never the whole model. ``adapted``: the modules carrying an adapter (:func:`adapted_modules`)."""
    held: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, value in named:
        if ".lora_embedding_" in name:
            raise ValueError(f"{name}: merging LoRA adapters on embeddings is not supported; adapt linear layers only")
        plain = name.removeprefix(PEFT_PREFIX)
        piece = next((p for p in (".lora_A.", ".lora_B.", ".base_layer.") if p in plain), None)
        if piece is None:
            yield plain, value
            continue
        module = plain.split(piece)[0]
        if piece != ".base_layer." and not plain.endswith(f"{piece}{ADAPTER}.weight"):
            continue  # another adapter's tensor, or an adapter bias: not part of the merge
        if piece == ".base_layer.":
            plain = plain.replace(".base_layer.", ".")
            if not plain.endswith(".weight") or module not in adapted:
                yield plain, value  # a bias, or a layer without an adapter: as it is
                continue
        parts = held.setdefault(module, {})
        parts[piece] = (plain, value)
        if len(parts) == 3:
            del held[module]
            yield _merged(parts, scaling, fan_in_fan_out)
    if held:
        raise ValueError(f"adapted modules without a base weight, A and B each in the state dict: {sorted(held)}")


def _merged(
    parts: dict[str, tuple[str, torch.Tensor]], scaling: float, fan_in_fan_out: bool
) -> tuple[str, torch.Tensor]:
    """``W + scaling * B @ A`` (``W`` stored transposed with ``fan_in_fan_out``) in float32, in
    ``W``'s dtype."""
    plain, base = parts[".base_layer."]
    delta = (parts[".lora_B."][1].float() @ parts[".lora_A."][1].float()) * scaling
    if fan_in_fan_out:
        delta = delta.T
    return plain, (base.float() + delta).to(base.dtype)


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
    place (:mod:`core_rl.checkpoint.files`)."""
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
