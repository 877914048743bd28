"""core-rl-dpo: the ``dpo`` training loop and the ``dpo`` / ``ipo`` recipes (see :mod:`.loop`)."""
