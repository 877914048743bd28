"""No silent failure: progress, the watchdog, deadlines on plugin code, and the note a rank leaves when
it exits."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.reliability.progress": ("PROGRESS",),
        "core_rl.reliability.own_loop": ("awaitable_error",),
    },
)
