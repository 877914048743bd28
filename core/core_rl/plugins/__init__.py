"""The plugin host: discovery through entry points, the registries, the kinds, building components and
holding them to their contracts."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.plugins.callables": (
            "CALLABLE",
            "LoadFailed",
            "is_async",
            "load_callable",
        ),
        "core_rl.plugins.components": ("build_component",),
        "core_rl.plugins.host": ("PluginHost",),
        "core_rl.plugins.kinds": (
            "REWARD",
            "ROLLOUT_ENGINE",
            "SERVER_ENV",
            "TOOL_PARSER",
            "TRAIN_ENGINE",
        ),
        "core_rl.plugins.lazy_exports": ("lazy_exports",),
        "core_rl.plugins.registry": ("RegistryEntry",),
    },
)
