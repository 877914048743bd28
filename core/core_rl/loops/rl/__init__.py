"""The ``rl`` loop: one RL step and its stages."""
