"""Inference servers as child processes, their environments, and the rollout engine that talks to them
over HTTP."""
