"""Build what the supervised examples (``sft.yaml``, ``dpo.yaml``, ``kto.yaml``, ``rm.yaml``) read,
offline: a tiny random Llama model with a character tokenizer, and the task of examples/tiny_grpo
(reverse a 3-4 letter string) as SFT rows (prompt, response) and preference rows (prompt, chosen =
the reversal, rejected = letters the prompt does not contain), the same pairs as unpaired KTO rows
(``kto.jsonl``: each pair's chosen completion labelled true, its rejected one false), plus the
preference rows split into training and held-out pairs for reward-model training
(``rm_train.jsonl``, ``rm_val.jsonl``: one prompt in ten held out).

    python examples/tiny_supervised/prepare.py [--workdir runs/tiny_supervised]
    core-rl train examples/tiny_supervised/sft.yaml
    core-rl train examples/tiny_supervised/dpo.yaml
    core-rl train examples/tiny_supervised/kto.yaml
    core-rl train examples/tiny_supervised/rm.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from core_rl.testing.tiny import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny_grpo"))

from task import LETTERS, all_strings, answer, prompt_text

SIDES = ("chosen", "rejected")


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
    pairs = [{"prompt": prompt_text(s), "chosen": answer(s), "rejected": wrong_letters(s, rng)} for s in strings]
    write_jsonl(data / "pairs.jsonl", pairs)
    kto = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in pairs for side in SIDES]
    write_jsonl(data / "kto.jsonl", kto)
    write_jsonl(data / "rm_train.jsonl", [p for i, p in enumerate(pairs) if i % 10 != 0])
    write_jsonl(data / "rm_val.jsonl", [p for i, p in enumerate(pairs) if i % 10 == 0])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/tiny_supervised")
    prepare(Path(parser.parse_args().workdir))
