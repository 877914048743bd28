"""core-rl-reward-model: the ``reward_model`` reward (see :mod:`.reward`)."""
