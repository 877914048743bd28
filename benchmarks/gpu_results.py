"""The results file of ``benchmarks/gpu_grpo.py``'s bench card (``benchmarks/results/gpu.md``): a
markdown table with a row per run and shape, and the regression rule that marks a row.

A row is flagged against the last row before it of the same device and shape: a regression is
``s/step`` up by more than 5% (``new > 1.05 * previous``), or ``gen tok/s``, ``train tok/s`` or
``MFU`` down by more than 5% (``new < 0.95 * previous``); a figure either row lacks (an unknown MFU)
is not compared. The row's ``flags`` column names each regression (``none`` if there is none, ``-``
for the first row of its device and shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: how much worse a figure may be than the previous row's before it is flagged
THRESHOLD = 0.05

#: the figures compared, and whether a higher value is worse
COMPARED: tuple[tuple[str, bool], ...] = (
    ("s/step", True),
    ("gen tok/s", False),
    ("train tok/s", False),
    ("MFU %", False),
)

FIELDS: tuple[str, ...] = (
    "date",
    "device",
    "torch",
    "transformers",
    "commit",
    "shape",
    "s/step",
    "generate",
    "train",
    "sync",
    "other",
    "gen tok/s",
    "train tok/s",
    "TFLOP/step",
    "MFU %",
    "peak GiB",
    "flags",
)

HEADER = """# GPU bench card results

Rows appended by `python benchmarks/gpu_grpo.py` (core-rl's side of each shape; see
`docs/benchmarks.md`, "Bench card"). Columns: `date` (UTC), `device` (`torch.cuda.get_device_name`),
`torch` and `transformers` (versions), `commit` (`git rev-parse --short HEAD`, `+dirty` with
uncommitted changes to tracked files), `shape` (name, parameters, prompts x samples x response
tokens); seconds per step (medians over the steps after each run's first): `s/step` and its split
`generate`, `train` (forward, backward, optimizer), `sync` (weight sync), `other`; `gen tok/s`
(generated tokens / generate s), `train tok/s` (prompt + response tokens / train s), `TFLOP/step`
(the update's, `6*N*D + 12*L*H*S*D`), `MFU %` (TFLOP/step / train s / the device's peak dense
bf16 FLOP/s; `unknown` without a peak), `peak GiB` (`torch.cuda.max_memory_allocated`); `flags`:
the regressions against the last row of the same device and shape (s/step up, or tokens/s or MFU
down, by more than 5%), `none`, or `-` for the first such row.

"""


@dataclass(frozen=True)
class Flag:
    """One figure worse than the previous row's by more than :data:`THRESHOLD`."""

    figure: str
    previous: float
    new: float

    @property
    def change(self) -> float:
        """Relative change, ``new / previous - 1``."""
        return self.new / self.previous - 1.0

    def text(self) -> str:
        """``"s/step +8.0%"``."""
        return f"{self.figure} {100 * self.change:+.1f}%"


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return None


def regressions(new: dict[str, str], previous: dict[str, str]) -> list[Flag]:
    """The figures of ``new`` worse than ``previous``'s by more than :data:`THRESHOLD` (rows as
    read from the file: strings by column); figures that are not numbers in both are skipped."""
    flags = []
    for figure, higher_is_worse in COMPARED:
        a, b = _number(previous.get(figure, "")), _number(new.get(figure, ""))
        if a is None or b is None or a <= 0:
            continue
        worse = b > (1 + THRESHOLD) * a if higher_is_worse else b < (1 - THRESHOLD) * a
        if worse:
            flags.append(Flag(figure, a, b))
    return flags


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of the results table in ``path`` (``[]`` if there is no file), by column name."""
    if not path.is_file():
        return []
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip().startswith("|")]
    if not lines:
        return []
    names = _cells(lines[0])
    return [dict(zip(names, _cells(line))) for line in lines[2:]]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def last_row(rows: list[dict[str, str]], device: str, shape: str) -> dict[str, str] | None:
    """The last of ``rows`` of ``device`` and ``shape``, or ``None``."""
    same = [r for r in rows if r.get("device") == device and r.get("shape") == shape]
    return same[-1] if same else None


def create(path: Path) -> None:
    """Write :data:`HEADER` and the table's heading (no rows) to ``path`` unless it exists."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    heading = "| " + " | ".join(FIELDS) + " |\n|" + "---|" * len(FIELDS) + "\n"
    path.write_text(HEADER + heading, encoding="utf-8")


def append(path: Path, row: dict[str, str]) -> list[Flag]:
    """Append ``row`` (values by :data:`FIELDS` but ``flags``) to the table in ``path``, creating the
    file with :data:`HEADER` and the table's heading if needed; its ``flags`` column is set from
    :func:`regressions` against :func:`last_row`. Returns the flags."""
    previous = last_row(read_rows(path), row["device"], row["shape"])
    flags = regressions(row, previous) if previous is not None else []
    mark = "-" if previous is None else ("; ".join(f.text() for f in flags) if flags else "none")
    if flags:
        mark = "REGRESSION: " + mark
    values = {**row, "flags": mark}
    create(path)
    with path.open("a", encoding="utf-8") as f:
        f.write("| " + " | ".join(values.get(k, "").replace("|", "/") for k in FIELDS) + " |\n")
    return flags
