"""core-rl-slurm: the ``slurm`` launcher and the ``core-rl slurm render|submit`` commands (see
:mod:`.plugin`, :mod:`.script`, :mod:`.submit`)."""
