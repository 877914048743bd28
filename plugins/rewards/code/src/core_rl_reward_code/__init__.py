"""core-rl-reward-code: the ``code`` reward (see :mod:`.reward`) and its sandbox (:mod:`.sandbox`)."""
