"""The models of a run: building each role's engine, model-directory checks and overrides, and
model paths resolved through the model sources (:mod:`core_rl.roles.model_sources`; a ``.gguf``
file is core-rl-gguf's)."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.roles.build": (
            "build_engine",
            "engine_heads",
            "missing_head_problem",
        ),
        "core_rl.roles.model_sources": ("models_root",),
        "core_rl.roles.remote_code": (
            "rollout_factory_kwargs",
            "untrusted_code_problem",
        ),
    },
)
