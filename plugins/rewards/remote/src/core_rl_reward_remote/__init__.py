"""core-rl-reward-remote: the ``remote`` reward (see :mod:`.reward`)."""
