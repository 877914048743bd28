"""Kept for compatibility: the tiny model builder lives in :mod:`core_rl.roles.tiny` (importable without
pytest, for examples and users); import it from there."""

from core_rl.roles.tiny import DEFAULT_ALPHABET, build_char_tokenizer, build_tiny_model

__all__ = ["DEFAULT_ALPHABET", "build_char_tokenizer", "build_tiny_model"]
