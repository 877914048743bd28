"""The supervised loops' base (SFT, DPO, reward-model training) and the sequences they train on."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.loops.supervised.loop": (
            "SupervisedLoop",
            "global_sum",
            "prompt_response_batch",
            "sequence_batch",
        ),
        "core_rl.loops.supervised.pairwise": (
            "PairwiseLoop",
            "number_in_row",
        ),
        "core_rl.loops.supervised.sequences": (
            "TrainSequence",
            "fit_to_length",
            "pair_sequences",
            "response_tokens",
        ),
    },
)
