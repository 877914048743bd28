"""core-rl-tensorboard: the ``tensorboard`` logger (see :mod:`.logger`)."""
