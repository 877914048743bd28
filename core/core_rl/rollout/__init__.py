"""The rollout side of a run: the controller, chat templates, stop strings, dumps and replays,
colocation."""
