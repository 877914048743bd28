"""Build what the supervised examples (``sft.yaml``, ``dpo.yaml``) read, offline: a tiny random
Llama model with a character tokenizer, and the task of examples/tiny_grpo (reverse a 3-4 letter
string) as SFT rows (prompt, response) and preference rows (prompt, chosen = the reversal,
rejected = letters the prompt does not contain).

    python examples/tiny_supervised/prepare.py [--workdir runs/tiny_supervised]
    core-rl train examples/tiny_supervised/sft.yaml
    core-rl train examples/tiny_supervised/dpo.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from core_rl.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny_grpo"))

from task import LETTERS, all_strings, answer, prompt_text


def wrong_letters(s: str, rng: random.Random) -> str:
    """An answer of the right length made of letters the prompt does not contain (a 3-4 letter
    string leaves at least two of the six unused)."""
    unused = [c for c in LETTERS if c not in s]
    return "".join(rng.choice(unused) for _ in s)


def prepare(workdir: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    build_tiny_model(workdir / "model", alphabet=LETTERS + "=", seed=seed)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    strings = [s for s in all_strings() if s != answer(s)]
    with (data / "sft.jsonl").open("w", encoding="utf-8") as f:
        for s in strings:
            f.write(json.dumps({"prompt": prompt_text(s), "response": answer(s)}) + "\n")
    with (data / "pairs.jsonl").open("w", encoding="utf-8") as f:
        for s in strings:
            f.write(
                json.dumps({"prompt": prompt_text(s), "chosen": answer(s), "rejected": wrong_letters(s, rng)}) + "\n"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/tiny_supervised")
    prepare(Path(parser.parse_args().workdir))
