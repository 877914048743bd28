"""core-rl-swanlab: the ``swanlab`` logger (see :mod:`.logger`)."""
