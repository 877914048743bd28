"""The dpo plugin's tests import their shared tiny task (``pair_task``) from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
