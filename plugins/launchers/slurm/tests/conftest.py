"""The slurm launcher's tests import their helper (:mod:`local_slurm`) from this directory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
