"""Training data: data files, prompt rows and mixtures."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.data.balance": (
            "karmarkar_karp",
            "row_lengths",
        ),
        "core_rl.data.files": (
            "DataRow",
            "Problems",
            "kind_of",
        ),
        "core_rl.data.prompts": (
            "PromptItem",
            "missing_column_problems",
        ),
        "core_rl.data.sources": ("DataSource",),
    },
)
