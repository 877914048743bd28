"""GGUF files as model paths: ``actor.model_path: /models/SmolLM2-135M-Instruct.Q4_1.gguf``.

A ``.gguf`` file (llama.cpp's single-file format: weights, often quantised, plus the tokenizer, its
chat template and the architecture's hyper-parameters) is turned once into a plain Hugging Face
directory, which is what every engine and inference server then loads:

- weights de-quantised to float32 by transformers (with the ``gguf`` package), then rebuilt as a
  plain model of the same architecture (a GGUF-loaded model cannot ``save_pretrained``), tied
  weights tied again, and saved as safetensors;
- the tokenizer, with its chat template and special tokens;
- a ``generation_config.json`` from the file's bos/eos/pad ids;
- ``core-rl-gguf.json``: the source file, its SHA-256 and when it was converted.

The directory lives in the cache, ``$CORE_RL_HOME/models/gguf-<first 16 hex digits of the file's
SHA-256>`` (``CORE_RL_HOME`` defaults to ``~/.cache/core-rl``: :func:`core_rl.roles.models_root`), so
the same file is converted once whatever its name or path, and a changed file gets a directory of its
own. Conversion is written to a partial directory and moved into place when complete, under a lock:
concurrent processes (the ranks of one run) convert once and the others wait.

The ``gguf`` model source (:class:`core_rl_gguf.source.GGUFSource`) does this for every
``model_path`` / ``tokenizer_path`` of a configuration naming a ``.gguf`` file, as the configuration
loader asks it, before anything reads them. Importing this module imports neither torch nor
transformers (nor the ``gguf`` package): a conversion does, when it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from core_rl.errors import CoreRLError
from core_rl.roles import models_root

SUFFIX = ".gguf"
RECORD = "core-rl-gguf.json"


class GGUFError(CoreRLError):
    """A GGUF file that cannot be converted (missing, unreadable, or the ``gguf`` package absent)."""


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; it may not exist)."""
    return str(path).lower().endswith(SUFFIX)


def file_digest(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def converted_dir(digest: str) -> Path:
    """Where the conversion of the GGUF file with SHA-256 ``digest`` lives (whatever its name)."""
    return models_root() / f"gguf-{digest[:16]}"


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_converted(path: str | os.PathLike[str], notify: Callable[[str], None] | None = None) -> Path:
    """The Hugging Face directory converted from the GGUF file ``path``: from the cache, or converted
    now (and cached; see the module docstring). ``notify`` receives one line when a conversion runs.
    Raises :class:`GGUFError` for a missing file, an absent ``gguf`` package or a file transformers
    cannot read."""
    source = Path(path).expanduser().absolute()
    if not source.is_file():
        raise GGUFError(f"{source}: no such GGUF file")
    digest = file_digest(source)
    target = converted_dir(digest)
    if (target / RECORD).is_file():
        return target
    with _locked(target):
        if (target / RECORD).is_file():  # another process converted it while this one waited
            return target
        if notify is not None:
            size = source.stat().st_size / 2**20
            notify(f"converting {source.name} ({size:.0f} MiB) once into {target}")
        # the public home of the atomic directories; it imports torch, which converting needs anyway
        from core_rl.checkpoint import files as atomic_files

        start = time.perf_counter()
        tmp = atomic_files.prepare_partial(target)
        try:
            convert(source, tmp)
            record = {
                "source": str(source),
                "sha256": digest,
                "converted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.perf_counter() - start, 1),
            }
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        except BaseException:
            atomic_files.discard_partial(target)
            raise
        atomic_files.commit_partial(target)
    return target


@contextlib.contextmanager
def _quiet_conversion() -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar of its own, and its loader another: neither belongs
    in a run's output."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    original = gguf_utils.tqdm
    gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        if bars:
            transformers.utils.logging.enable_progress_bar()


def convert(source: Path, out: Path) -> None:
    """Write the Hugging Face directory of the GGUF file ``source`` into the existing directory
    ``out``: config, float32 safetensors weights (a plain model of the file's architecture, its tied
    weights tied), tokenizer with its chat template, generation config."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise GGUFError(
            f"{source}: reading a GGUF file needs the gguf package: pip install gguf (or core-rl[gguf])"
        ) from None
    import torch
    from core_rl.roles.hf import save_pretrained
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(source.parent), source.name
    with _quiet_conversion():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # struct.error: transformers' reader of a file cut short (fewer bytes than its header says)
        except (ValueError, KeyError, OSError, RuntimeError, struct.error) as exc:
            raise GGUFError(f"{source}: transformers cannot read it as a causal LM ({exc})") from None
        state = loaded.state_dict()
        del loaded
        for key in ("quantization_config", "_name_or_path"):
            config.__dict__.pop(key, None)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        if getattr(config, "tie_word_embeddings", False):
            head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
            if head is not None and head.weight is not embedding.weight:
                raise GGUFError(f"{source}: the output head did not tie to the input embedding after conversion")
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        save_pretrained(model, out)  # not model.save_pretrained: that imports DeepSpeed, which warns
        tokenizer.save_pretrained(out)
