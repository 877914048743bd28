"""The example task: which colour is the square.

Each image is ``SIZE x SIZE`` pixels, a light grey background with a ``SQUARE``-pixel square of one
of :data:`COLOURS` at a random place. The row is ``{"prompt": "colour?", "images": [PATH],
"answer": COLOUR}``; the ``exact_match`` reward scores 1 for the square's colour, else 0. A policy
that only knows the answer format (a colour word, drawn at random) scores ``1 / len(COLOURS)``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 30)}
SIZE, SQUARE = 16, 8
BACKGROUND = (200, 200, 200)
PROMPT = "colour?"


def draw(colour: str, rng: random.Random):
    """A ``SIZE x SIZE`` RGB ``PIL`` image with a ``colour`` square at a random place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    x, y = rng.randrange(SIZE - SQUARE + 1), rng.randrange(SIZE - SQUARE + 1)
    ImageDraw.Draw(image).rectangle([x, y, x + SQUARE - 1, y + SQUARE - 1], fill=COLOURS[colour])
    return image


def write_dataset(path: Path, count: int, seed: int) -> Path:
    """``count`` rows (colours in turn, places random with ``seed``), their images as PNG files in
    ``images/`` beside ``path`` (the rows name them relative to the data file)."""
    rng = random.Random(seed)
    folder = path.parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    with path.open("w", encoding="utf-8") as f:
        for i in range(count):
            colour = names[i % len(names)]
            name = f"{path.stem}_{i}.png"
            draw(colour, rng).save(folder / name)
            f.write(json.dumps({"prompt": PROMPT, "images": [f"images/{name}"], "answer": colour}) + "\n")
    return path


def write_warm_start_data(path: Path, count: int, seed: int) -> Path:
    """SFT rows of the answer format only: each image's answer a colour drawn at random (not the
    square's), so the warm-started policy answers with a colour word but must learn which from reward."""
    rng = random.Random(seed + 1)
    rows = [json.loads(line) for line in write_dataset(path, count, seed).read_text().splitlines()]
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            answer = rng.choice(list(COLOURS))
            f.write(json.dumps({"prompt": row["prompt"], "images": row["images"], "response": answer}) + "\n")
    return path
