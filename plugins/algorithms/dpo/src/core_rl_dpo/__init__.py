"""core-rl-dpo: the ``dpo`` training loop and the ``dpo`` / ``ipo`` / ``simpo`` / ``orpo`` recipes (see
:mod:`.loop`), and the ``kto`` loop and recipe (see :mod:`.kto`)."""
