"""Reading a Hugging Face model directory tensor by tensor (safetensors, single file or sharded with
an index), so a rank only ever holds the tensors it is converting."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from core_rl_megatron.errors import MegatronSetupError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFWeights:
    """The tensors of a Hugging Face model directory by name, read lazily with ``safe_open``.
    Use as a context manager (it keeps the files open)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        elif (self.dir / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.dir / SINGLE_FILE), framework="pt") as f:
                self.files = {name: self.dir / SINGLE_FILE for name in f.keys()}
        else:
            raise MegatronSetupError(
                f"actor.model_path: {self.dir} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                "the megatron engine reads Hugging Face safetensors checkpoints only"
            )
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._open.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> Iterator[str]:
        return iter(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise MegatronSetupError(f"actor.model_path: {self.dir} has no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path].get_tensor(name)


def load_hf_config(model_dir: str | Path) -> Any:
    """The transformers config of ``model_dir`` (local files only)."""
    from transformers import AutoConfig

    if not model_dir:
        raise MegatronSetupError("actor.model_path: required; the path of a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise MegatronSetupError(
            f"actor.model_path: cannot read a Hugging Face config from {model_dir}: {exc}"
        ) from None
