"""One trainer rank in the process a :class:`~core_rl_ray.actors.TrainerRank` actor starts:
``python -m core_rl_ray.rank RENDEZVOUS_JSON CONFIG [KEY=VALUE ...]``, run through the core's
:func:`core_rl.cli.run_rank` (exit status as ``core-rl train``'s)."""

from __future__ import annotations

import json
import sys

from core_rl.cli import run_rank
from core_rl.launch import Rendezvous


def main(argv: list[str]) -> int:
    rendezvous = Rendezvous(**json.loads(argv[0]))
    return run_rank(argv[1], argv[2:], rendezvous)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
