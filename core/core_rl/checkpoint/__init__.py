"""Checkpoints: atomic files, where a run keeps them, when they are saved, and resuming from them."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.checkpoint.atomic": ("write_text_atomic",),
        "core_rl.checkpoint.resume": ("effective_recover_mode",),
    },
)
