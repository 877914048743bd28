"""Components that ship with core-rl itself; they register through the same hooks and entry points
as any third-party plugin (see the ``core_rl.loggers`` entry points in the root pyproject.toml)."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.builtin.launchers": ("this_machine",),
        "core_rl.builtin.loggers": ("read_metrics",),
    },
)
