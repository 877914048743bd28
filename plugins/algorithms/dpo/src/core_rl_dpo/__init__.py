"""core-rl-dpo: the ``dpo`` training loop and the ``dpo`` / ``ipo`` / ``simpo`` / ``orpo`` recipes (see
:mod:`.loop`)."""
