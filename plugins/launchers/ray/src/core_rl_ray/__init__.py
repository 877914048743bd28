"""core-rl's ``ray`` launcher: trainer ranks and rollout servers as Ray actors (see
:mod:`core_rl_ray.launcher`)."""

__version__ = "0.1.0"
