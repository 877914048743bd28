"""core-rl's reasoning-gym plugin: the data source and the reward named ``reasoning_gym``."""
