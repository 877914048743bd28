"""Checkpoints: atomic files, where a run keeps them, when they are saved, and resuming from them."""
