"""Rows of the digit game for core-rl's ``function`` data source: a prompt and a ``seed`` (the
plugin's ``reset_keys`` hand it to the game's ``reset``, which makes the secret ``seed % 10``)."""


def rows(count: int = 8, seed: int = 0) -> list[dict]:
    """``count`` rows, seeds ``seed`` .. ``seed + count - 1``."""
    return [{"prompt": "Guess my digit (0-9):", "seed": seed + i} for i in range(count)]
