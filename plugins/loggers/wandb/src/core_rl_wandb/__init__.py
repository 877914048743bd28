"""core-rl-wandb: the ``wandb`` logger (see :mod:`.logger`)."""
