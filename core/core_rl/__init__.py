"""core-rl: a plugin-based reinforcement-learning post-training framework for language models."""

__version__ = "0.1.0"

from core_rl.hookspecs import HOOK_API_VERSION, hookimpl

__all__ = ["HOOK_API_VERSION", "__version__", "hookimpl"]
