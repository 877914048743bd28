"""core-rl: a plugin-based reinforcement-learning post-training framework for language models."""

__version__ = "0.1.0"

from core_rl.hookspecs import HOOK_API_VERSION, hookimpl
from core_rl.plugins import moved_modules as _moved_modules

__all__ = ["HOOK_API_VERSION", "__version__", "hookimpl"]

_moved_modules.install()  # the old module paths, for one release
