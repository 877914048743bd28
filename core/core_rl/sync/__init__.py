"""Moving the policy's weights to the rollout engine, and verifying that it serves them."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.sync.lora": (
            "NAME_PREFIX",
            "adapter_name",
        ),
    },
)
