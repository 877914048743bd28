"""core-rl-sft: the ``sft`` training loop and recipe (see :mod:`.loop`)."""
