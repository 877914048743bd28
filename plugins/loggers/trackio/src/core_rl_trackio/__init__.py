"""core-rl-trackio: the ``trackio`` logger (see :mod:`.logger`)."""
