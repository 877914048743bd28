"""Evaluation: on held-out prompts while training, and ``core-rl eval``."""
