"""core-rl-rm: the ``rm`` training loop and recipe (see :mod:`.loop`)."""
