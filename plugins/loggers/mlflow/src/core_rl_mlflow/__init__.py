"""core-rl-mlflow: the ``mlflow`` logger (see :mod:`.logger`)."""
