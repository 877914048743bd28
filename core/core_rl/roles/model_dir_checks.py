"""Checks of a Hugging Face model or tokenizer directory that load no weight (part of
:mod:`core_rl.loops.preflight`): ``config.json`` valid JSON of a model type transformers reads (a
directory that ships its own modelling code only with its role's ``trust_remote_code``,
:mod:`core_rl.roles.remote_code`), complete weight files (safetensors headers parsed and checked against
the file's size; every shard an index lists), and a tokenizer that loads. Each problem is one line
naming the file or the config key."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

from core_rl.config.checks import ModelInfo
from core_rl.roles.remote_code import untrusted_code_problem

#: files of which a tokenizer directory holds at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` of an exception, for a one-line problem."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _read_json(path: Path) -> tuple[Any, str | None]:
    """A JSON file's value, or a problem naming the file and the 1-based line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return None, f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); the file is corrupt"
    except OSError as exc:
        return None, f"{path}: cannot read it: {exc.strerror or exc}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"{path}:{exc.lineno}:{exc.colno}: corrupt JSON ({exc.msg})"
    if not isinstance(value, dict):
        return None, f"{path}: expected a JSON object, got {type(value).__name__}"
    return value, None


def missing_directory(key: str, path: str, offline: bool) -> str:
    message = f"{key}: {path!r} does not exist"
    if offline and _HUB_ID.fullmatch(path):
        message += (
            f"; it looks like a Hugging Face hub id, and core-rl does not download by default: run "
            f"`hf download {path} --local-dir DIR` and set {key}: DIR, or set experiment.offline=false to let "
            "core-rl download it into the Hugging Face cache"
        )
    return message


def _safetensors_problems(path: Path) -> list[str]:
    """Parse a safetensors header and check it against the file's size (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            count = len(list(f.keys()))
    except Exception as exc:  # SafetensorError for truncated or garbage files, OSError
        return [f"{path}: not a complete safetensors file ({first_line(exc)}); re-export or re-download the model"]
    if count == 0:
        return [f"{path}: holds no tensors; re-export or re-download the model"]
    return []


def _torch_bin_problems(path: Path) -> list[str]:
    if not zipfile.is_zipfile(path):
        return [f"{path}: not a complete PyTorch checkpoint (not a zip archive); re-export or re-download the model"]
    return []


def _sharded_problems(index_path: Path, check: Any) -> list[str]:
    index, problem = _read_json(index_path)
    if problem is not None:
        return [problem]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return [f"{index_path}: has no weight_map naming the weight files; the index is corrupt"]
    problems = []
    for shard in sorted({str(v) for v in weight_map.values()}):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            problems.append(f"{shard_path}: missing, although {index_path.name} lists it")
        else:
            problems.extend(check(shard_path))
    return problems


def weights_problems(model_dir: Path) -> list[str]:
    """Problems with the weight files transformers would load from ``model_dir``."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return _safetensors_problems(single)
    if (model_dir / "model.safetensors.index.json").is_file():
        return _sharded_problems(model_dir / "model.safetensors.index.json", _safetensors_problems)
    if (model_dir / "pytorch_model.bin").is_file():
        return _torch_bin_problems(model_dir / "pytorch_model.bin")
    if (model_dir / "pytorch_model.bin.index.json").is_file():
        return _sharded_problems(model_dir / "pytorch_model.bin.index.json", _torch_bin_problems)
    return [
        f"{model_dir}: no model weights (model.safetensors, model.safetensors.index.json with its shards, or "
        "pytorch_model.bin); point actor.model_path at a complete Hugging Face model directory"
    ]


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_model_dir(
    path: str, key: str, *, offline: bool = True, trust_remote_code: bool = False
) -> tuple[ModelInfo | None, list[str]]:
    """Check a Hugging Face model directory without loading its weights: ``config.json`` (valid
    JSON that transformers reads; one with an ``auto_map`` only with ``trust_remote_code``, else a
    problem naming ``key``'s section's switch) and complete weight files. Returns what the config
    says."""
    directory = Path(path)
    if not directory.exists():
        return None, [missing_directory(key, path, offline)]
    if not directory.is_dir():
        return None, [f"{key}: {path!r} is a file; it must be a Hugging Face model directory"]
    problems = weights_problems(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        problems.insert(0, f"{key}: {path!r} has no config.json; it is not a Hugging Face model directory")
        return None, problems
    _, problem = _read_json(config_file)
    if problem is not None:
        return None, [problem, *problems]
    untrusted = untrusted_code_problem(directory, key, trust_remote_code)
    if untrusted is not None:
        return None, [untrusted, *problems]
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # transformers refusing the user's config.json (unknown model_type, ...)
        return None, [f"{config_file}: transformers cannot read it: {first_line(exc)}", *problems]
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    info = ModelInfo(
        path=str(directory),
        vocab_size=_positive_int(getattr(text_config, "vocab_size", None)),
        max_position_embeddings=_positive_int(getattr(text_config, "max_position_embeddings", None)),
        model_type=getattr(hf_config, "model_type", None),
        rope_factor=_rope_factor(text_config),
    )
    return info, problems


def _rope_factor(text_config: Any) -> float:
    """The ``factor`` of a scaled RoPE (``rope_parameters``, or ``rope_scaling`` before
    transformers 5), 1 without one (:attr:`ModelInfo.context_length` never shrinks the context by it)."""
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    factor = rope.get("factor") if isinstance(rope, dict) else None
    return float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0


def check_tokenizer_dir(
    path: str, key: str, *, offline: bool = True, trust_remote_code: bool = False
) -> tuple[Any, list[str]]:
    """Check that ``path`` holds a tokenizer and load it (tokenizers are small; no model is
    loaded), running the directory's own tokenizer code only with ``trust_remote_code`` (else a
    directory that ships code is a problem naming the switch). Returns the tokenizer, or ``None``
    with the problems."""
    directory = Path(path)
    if not directory.exists():
        return None, [missing_directory(key, path, offline)]
    if not directory.is_dir():
        return None, [f"{key}: {path!r} is a file; it must be a directory holding a tokenizer"]
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None, [
            f"{key}: {path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); set actor.tokenizer_path "
            "to the directory of the model's tokenizer"
        ]
    if (directory / "tokenizer.json").is_file():
        _, problem = _read_json(directory / "tokenizer.json")
        if problem is not None:
            return None, [problem]
    untrusted = untrusted_code_problem(directory, key, trust_remote_code)
    if untrusted is not None:
        return None, [untrusted]
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=trust_remote_code
        )
        return tokenizer, []
    except Exception as exc:  # the user's tokenizer files, however transformers refuses them
        return None, [f"{key}: transformers cannot load the tokenizer in {path!r}: {first_line(exc)}"]
