"""Hugging Face model I/O shared by train engines: load a causal LM from local files, and write a
model (config, safetensors weights, generation config, tokenizer) as a directory, atomically."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core_rl.checkpoint import files as ckpt
from core_rl.config.flash_attention import FLASH_ATTENTION_DTYPES
from core_rl.config.schema import ActorConfig, LoraConfig
from core_rl.errors import ConfigError
from core_rl.roles.freezing import freeze_parameters
from core_rl.roles.wrapped import inner_model  # noqa: F401  (for engines and kits: one import of HF helpers)


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (any of ``float32``, ``bfloat16``, ``float16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_BARS = threading.Lock()
_bars_off = 0  # how many no_progress_bars() contexts are open
_bars_were_on = False


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Inside it transformers (and huggingface_hub) draw no progress bar: their "Loading weights"
    and "Writing model shards" bars stay out of a run's output. The setting before the first of
    several (nested or concurrent) contexts is restored when the last one closes."""
    from transformers.utils import logging as hf_logging

    global _bars_off, _bars_were_on
    with _BARS:
        if _bars_off == 0:
            _bars_were_on = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
        _bars_off += 1
    try:
        yield
    finally:
        with _BARS:
            _bars_off -= 1
            if _bars_off == 0 and _bars_were_on:
                hf_logging.enable_progress_bar()


def load_causal_lm(
    model_path: str, *, dtype: str, attn_implementation: str | None = None, trust_remote_code: bool = False
) -> nn.Module:
    """``AutoModelForCausalLM`` (a vision-language model's ``AutoModelForImageTextToText``:
    :func:`core_rl.vision.models.auto_model_class`) from ``model_path`` (local files only, never the
    hub) in ``dtype``, on CPU; ``attn_implementation`` (e.g. ``sdpa``, ``eager``,
    ``flash_attention_2``) is passed through when set; ``trust_remote_code`` lets transformers run
    the directory's own modelling code (:mod:`core_rl.roles.remote_code`). Draws no progress bar
    (:func:`no_progress_bars`)."""
    from core_rl.vision.models import auto_model_class

    if not model_path:
        raise ValueError("actor.model_path: required; the path of a Hugging Face model directory")
    kwargs: dict[str, object] = {"dtype": torch_dtype(dtype), "local_files_only": True}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with no_progress_bars():
        return auto_model_class(model_path).from_pretrained(model_path, **kwargs)


def architecture_name(model: nn.Module) -> str:
    """The Hugging Face class name of ``model`` (``LlamaForCausalLM``), also after a sharding wrapper
    such as FSDP2 has swapped its class for a generated subclass (``FSDPLlamaForCausalLM``)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers") and issubclass(cls, nn.Module):
            return cls.__name__
    return type(model).__name__


def empty_causal_lm(
    model_path: str, *, dtype: str, attn_implementation: str | None = None, trust_remote_code: bool = False
) -> nn.Module:
    """The model of ``model_path``'s config with every parameter and buffer on the ``meta`` device
    (no memory, no weights read): for ranks that receive their weights from rank 0."""
    from transformers import AutoConfig

    from core_rl.vision.models import auto_model_class

    config = AutoConfig.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)
    kwargs: dict[str, object] = {"dtype": torch_dtype(dtype)}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return auto_model_class(model_path).from_config(config, **kwargs)


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package (flash-attn 2, CUDA only) can be imported."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(requested: str | None, device: torch.device, compute_dtype: str) -> str | None:
    """The attention implementation to load a model with: ``auto`` is ``flash_attention_2`` on a
    CUDA device when flash-attn is installed and the forward computes in ``compute_dtype`` bfloat16
    or float16 (flash-attn has no float32 kernels), else ``sdpa``; any other value (or ``None``: the
    transformers default) is passed through unchanged."""
    if requested != "auto":
        return requested
    flash = device.type == "cuda" and compute_dtype in FLASH_ATTENTION_DTYPES and flash_attn_available()
    return "flash_attention_2" if flash else "sdpa"


def activation_checkpointing_problems(context: Any) -> list[str]:
    """What the role section of an engine section (``context``: its
    :class:`~core_rl.config.checks.EnvironmentContext`, path ``<role>.engine``) asks of activation
    checkpointing that this transformers cannot do: every n-th layer and offloading need its
    ``activation_checkpointing_enable`` (5.23 and later)."""
    role, section = context.role_section()
    if section is None or not getattr(section, "gradient_checkpointing", False):
        return []
    if section.gradient_checkpointing_every_n_layers == 1 and not section.gradient_checkpointing_offload:
        return []
    import transformers
    from transformers import PreTrainedModel

    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        return []
    return [
        f"{role}.gradient_checkpointing_every_n_layers / gradient_checkpointing_offload: need transformers >= 5.23 "
        f"(installed: {transformers.__version__}); upgrade transformers, or keep every layer (1) and no offload"
    ]


def enable_activation_checkpointing(model: nn.Module, *, every_n_layers: int = 1, offload: bool = False) -> None:
    """Recompute decoder layers' activations in backward (non-reentrant ``torch.utils.checkpoint``)
    through transformers' own switch: every ``every_n_layers``-th decoder layer (1: all), the saved
    inputs kept in host memory with ``offload``. Call before sharding."""
    kwargs = {"use_reentrant": False}
    extra: dict[str, object] = {}
    if every_n_layers != 1:
        extra["every_n_layers"] = every_n_layers
    if offload:
        extra["offload"] = True
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    elif extra:
        raise ValueError(
            "actor.gradient_checkpointing_every_n_layers / gradient_checkpointing_offload need "
            "transformers >= 5.23 (activation_checkpointing_enable)"
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


_UNPROBED = threading.Lock()


@contextlib.contextmanager
def _deepspeed_unprobed() -> Iterator[None]:
    """While DeepSpeed is not imported, make accelerate's ``extract_model_from_parallel`` (which
    transformers' ``save_pretrained`` calls to unwrap a model) skip its ``DeepSpeedEngine`` check:
    that check imports DeepSpeed whenever it is installed, which prints DeepSpeed's accelerator
    warning in runs that never use it. No model can be a DeepSpeed engine before DeepSpeed is
    imported, so the unwrapping is unchanged."""
    if "deepspeed" in sys.modules:
        yield
        return
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps without it
        yield
        return
    with _UNPROBED:
        probe = other.is_deepspeed_available
        other.is_deepspeed_available = lambda: False
        try:
            yield
        finally:
            other.is_deepspeed_available = probe


def save_pretrained(model: Any, path: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(path, **kwargs)`` without importing DeepSpeed when the run does not
    use it (see :func:`_deepspeed_unprobed`) and without a progress bar (:func:`no_progress_bars`).
    Every Hugging Face model the core or a plugin writes goes through here."""
    with _deepspeed_unprobed(), no_progress_bars():
        model.save_pretrained(path, **kwargs)


def write_hf_dir(
    final: Path,
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    architectures: list[str],
    tokenizer_path: str,
    model_path: str | None = None,
    trust_remote_code: bool = False,
) -> None:
    """Write ``model``'s config with ``state_dict`` as its weights, plus the tokenizer read from
    ``tokenizer_path``, to ``final`` via a partial directory moved into place
    (:mod:`core_rl.checkpoint.files`). ``architectures`` is written into ``config.json`` (so a wrapper
    class name such as FSDP's never appears there). A model or tokenizer with its own code
    (``trust_remote_code``; ``model_path``: the directory the model was loaded from) keeps its code
    files and ``auto_map`` (:func:`core_rl.roles.remote_code.keep_custom_code`), so the export loads again;
    a vision-language model keeps its image processor (:func:`core_rl.vision.models.keep_image_processor`)."""
    from transformers import AutoTokenizer

    from core_rl.roles.remote_code import keep_custom_code
    from core_rl.vision.models import keep_image_processor

    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    tmp = ckpt.prepare_partial(final)
    try:
        save_pretrained(model, tmp, state_dict=state_dict)
        config_file = tmp / "config.json"
        config = json.loads(config_file.read_text())
        if config.get("architectures") != architectures:
            config["architectures"] = architectures
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        keep_image_processor([p for p in (tokenizer_path, model_path) if p], tmp)
        keep_custom_code([p for p in (model_path, tokenizer_path) if p], tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckpt.commit_partial(final)


def lora_problems(model_path: str, lora: LoraConfig, key: str, *, trust_remote_code: bool = False) -> list[str]:
    """What peft says of ``lora`` on the model of ``model_path``, found by applying the adapters to
    the model built on the ``meta`` device (:func:`empty_causal_lm`: no memory, no weights read). A
    model that cannot be built so is left to the engine, which loads it for real."""
    from core_rl.roles.lora import apply_lora

    try:
        model = empty_causal_lm(model_path, dtype="float32", trust_remote_code=trust_remote_code)
    except Exception:  # e.g. a model class that computes in __init__; the engine's load reports it
        return []
    try:
        apply_lora(model, lora, key)
    except ConfigError as exc:
        return exc.problems
    return []


#: float attributes through which attention modules apply dropout inside their kernels
DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0: each ``nn.Dropout`` (any kind), each float
    :data:`DROPOUT_ATTRIBUTES` attribute that attention modules hand their kernels, and each float
    ``*dropout*`` / ``*_pdrop`` setting of its config (some models read those in their forward), so
    an export records 0 (the model trained without dropout); returns how many were above 0."""
    changed = 0
    config = getattr(model, "config", None)
    for name, value in vars(config).items() if config is not None else ():
        if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
            changed += 1
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
        for name in DROPOUT_ATTRIBUTES:
            value = vars(module).get(name)
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed


def prepare_for_role(model: nn.Module, actor: ActorConfig, *, trainable: bool) -> nn.Module:
    """A trainable model loses its dropout (``actor.disable_dropout``: before adapters, so
    ``lora.dropout`` still applies), gets LoRA adapters when ``actor.lora`` asks (the returned
    model is then the peft wrapper), keeps the parameters ``actor.freeze`` names frozen
    (:mod:`core_rl.roles.freezing`) and gets activation checkpointing when
    ``actor.gradient_checkpointing`` is on; a frozen one (a reference model: the base model, never
    adapters) gets no gradients and eval mode."""
    if not trainable:
        model.requires_grad_(False)
        model.eval()
        return model
    if actor.disable_dropout:
        disable_dropout(model)
    freeze_parameters(model, actor.freeze)  # actor.freeze (refused with LoRA)
    if actor.lora.enabled:
        from core_rl.roles.lora import apply_lora

        model = apply_lora(model, actor.lora)
    if actor.gradient_checkpointing:
        enable_activation_checkpointing(
            model,
            every_n_layers=actor.gradient_checkpointing_every_n_layers,
            offload=actor.gradient_checkpointing_offload,
        )
    return model


def value_model_config(model_path: str, *, bias: bool = True, trust_remote_code: bool = False):
    """The config of a value model on ``model_path``'s backbone: one output per token
    (``num_labels=1``), no dropout in its head (``classifier_dropout=0``), and a bias in the head
    unless ``bias=False`` (a reward model: the head of Hugging Face's ``*ForSequenceClassification``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        model_path, local_files_only=True, num_labels=1, trust_remote_code=trust_remote_code
    )
    config.classifier_dropout = 0.0
    config.token_classification_bias = bias
    return config


def load_value_model(
    model_path: str,
    *,
    dtype: str,
    attn_implementation: str | None = None,
    bias: bool = True,
    gathered: Callable[[list[nn.Parameter]], AbstractContextManager[object]] | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A value model: ``AutoModelForTokenClassification`` with one output (the backbone of
    ``model_path`` plus a scalar head per token, with a bias unless ``bias=False``), local files only,
    on CPU. A head the directory does not hold (e.g. a causal LM's directory) starts at zero, so every
    rank and every run starts from the same values (0); a value model's own export is loaded as saved.
    Loading leaves the global random state as it was (transformers draws the missing head's initial
    weights from it), so a run samples the same whichever engine builds its value model.

    Starting from a causal LM is the expected case, so transformers' load report (its ``lm_head``
    unexpected, the ``score`` head missing) is not printed; a missing weight outside the head is a
    ``ValueError`` naming it (the directory does not hold this backbone).

    ``gathered(params)``: a context inside which ``params`` hold their full values and writes to
    them last, for parameters partitioned as they were built (DeepSpeed ZeRO-3's
    ``GatheredParameters``); ordinary parameters need none."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    if not model_path:
        raise ValueError("critic.model_path: required; the path of a Hugging Face model directory")
    kwargs: dict[str, object] = {"dtype": torch_dtype(dtype), "local_files_only": True}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]), no_progress_bars():
            model, info = AutoModelForTokenClassification.from_pretrained(
                model_path,
                config=value_model_config(model_path, bias=bias, trust_remote_code=trust_remote_code),
                output_loading_info=True,
                **kwargs,
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = set(info.get("missing_keys", ()))
    prefix = f"{model.base_model_prefix}."
    backbone = sorted(k for k in missing if k.startswith(prefix))
    if backbone:
        shown = ", ".join(backbone[:4]) + (f" and {len(backbone) - 4} more" if len(backbone) > 4 else "")
        raise ValueError(
            f"critic.model_path: {model_path} does not hold the value model's backbone: {shown} missing; "
            "point it at the policy's model directory (or a value model exported by core-rl)"
        )
    head = [param for name, param in model.named_parameters() if name in missing]
    with torch.no_grad(), gathered(head) if gathered is not None else contextlib.nullcontext():
        for param in head:
            param.zero_()
    return model


def empty_value_model(
    model_path: str,
    *,
    dtype: str,
    attn_implementation: str | None = None,
    bias: bool = True,
    trust_remote_code: bool = False,
) -> nn.Module:
    """:func:`load_value_model`'s model on the ``meta`` device (see :func:`empty_causal_lm`)."""
    from transformers import AutoModelForTokenClassification

    kwargs: dict[str, object] = {"dtype": torch_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    config = value_model_config(model_path, bias=bias, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForTokenClassification.from_config(config, **kwargs)


def exported_architecture(name: str, head: str) -> str:
    """The ``architectures`` entry an engine writes for a model of class ``name`` with ``head``: a
    ``score`` head's token classifier (``LlamaForTokenClassification``, no bias) is exported as the
    sequence classifier with the same weight names (``LlamaForSequenceClassification``: the score of
    the last non-padding token), which is how a reward model is served."""
    if head == "score":
        return name.replace("ForTokenClassification", "ForSequenceClassification")
    return name


def loaders_for_head(head: str) -> tuple[Callable[..., nn.Module], Callable[..., nn.Module]]:
    """``(empty, load)`` for a model with ``head`` (:data:`core_rl.interfaces.HEADS`), each called as
    ``f(model_path, dtype=..., attn_implementation=..., trust_remote_code=...)``: the causal LM for
    ``lm``; the value model for ``value``, and without a bias in its head for ``score`` (a reward
    model, as Hugging Face's ``*ForSequenceClassification``)."""
    if head == "lm":
        return empty_causal_lm, load_causal_lm
    bias = head == "value"
    return functools.partial(empty_value_model, bias=bias), functools.partial(load_value_model, bias=bias)
