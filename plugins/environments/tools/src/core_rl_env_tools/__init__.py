"""core-rl environments: ``calculator``, ``python`` and ``reward`` (see the README)."""
