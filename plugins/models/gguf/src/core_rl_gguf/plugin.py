"""Registration of the ``gguf`` model source (entry point group ``core_rl.model_sources``). Light:
the source imports torch and transformers only when it converts a file."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_gguf.source import GGUFSource


@hookimpl
def core_rl_register_model_sources(register: Register) -> None:
    register(
        "gguf",
        GGUFSource,
        description="a .gguf model or tokenizer path, converted once into a cached Hugging Face directory",
    )
