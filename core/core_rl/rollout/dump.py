"""Each step's scored rollouts on disk (``rollout.dump``), in the file format the replay reads back
(``rollout.replay_from``, :mod:`core_rl.rollout.replay`).

**Files.** Step ``N`` goes to ``<dir>/step_<N:08d>.parquet`` (``dir``: ``rollout.dump.dir``, by
default ``<run>/rollouts``), written to ``.step_<N:08d>.parquet.tmp`` beside it, flushed to disk and
renamed into place (:func:`core_rl.checkpoint.atomic.atomic_file`): a step file is complete or absent,
and the replay never reads a name other than ``step_<8 digits>.parquet``.

**Why Parquet.** One file per step, compressed (zstd), without pickle, readable by pyarrow, pandas,
polars or DuckDB (``SELECT reward, response_text FROM 'runs/x/rollouts/*.parquet'``); ragged
token lists are native list columns; pyarrow is already installed with ``datasets``.

**Rows.** One row per sample the step trained from or filtered, in the order the reward runner kept
them (samples it dropped are not there), generation batch after generation batch:

=========================  ===============  ========================================================
column                     type             meaning
=========================  ===============  ========================================================
``generation``             int32            the step's generation batch (0, or more under dynamic sampling)
``group``                  int32            the prompt it answers, within its generation batch
``where``                  string           the data row (``file:line``)
``prompt_text``            string           the prompt and response as the reward saw them
``response_text``          string
``prompt_ids``             list<int32>      token ids
``response_ids``           list<int32>
``logprobs``               list<float32>    behaviour log-prob of each response token (the batch
                                            holds them as float32: nothing is lost)
``weight_version``         int64            :attr:`~core_rl.protocol.Sample.weight_version`
``token_weight_versions``  list<int64>      per-token versions (null: all ``weight_version``)
``token_mask``             list<int8>       1 on generated response tokens (null: all)
``finish_reason``          string           ``stop`` or ``length``
``reward``                 float64          the reward before ``algorithm.reward_shaping``
``reward_part:<name>``     float64          the reward's named parts
``workflow_reward``        float64          :attr:`~core_rl.protocol.Sample.reward` (null: none)
``turn_rewards``           list<float64>    per-turn rewards and their ends (null: none)
``turn_ends``              list<int32>
``info``                   string           :attr:`~core_rl.protocol.Sample.info` as JSON
``routed_experts``         list<int16>      :attr:`~core_rl.protocol.Sample.routed_experts` flattened
                                            (null: none), ``[tokens, L, K]`` with
``route_shape``            list<int32>      ``[L, K]`` (the routes of a mixture-of-experts rollout)
=========================  ===============  ========================================================

Advantages, shaped rewards, masks and the rest of the batch are not stored: the replay recomputes
them from these columns as the original step did (so a replay may also change the estimator).

**Header** (the file's key-value metadata under :data:`HEADER_KEY`, JSON): ``format``,
``format_version``, ``core_rl_version``, ``step``, ``weight_version`` (the policy version the step's
update started from, ``step - 1``), ``model_path``, ``tokenizer`` (``name_or_path``, ``vocab_size``
and a ``fingerprint`` of its vocabulary), ``config_hash`` (a SHA-256 prefix of each configuration
section that shapes training), ``max_token_id``, ``samples`` and ``generations`` (each generation
batch's sample count and metrics: reward errors, timings).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from core_rl import __version__
from core_rl.checkpoint.atomic import atomic_file
from core_rl.config.loader import to_plain
from core_rl.config.schema import RunConfig
from core_rl.loops.rl.batching import Generation
from core_rl.protocol import Sample

FORMAT = "core-rl rollout dump"
FORMAT_VERSION = 1
HEADER_KEY = b"core_rl.rollout_dump"
PART_PREFIX = "reward_part:"
STEP_NAME = re.compile(r"step_(\d{8})\.parquet")
#: configuration sections that do not change what a step trains on (left out of ``config_hash``)
UNHASHED = ("experiment", "loggers", "sample_log", "eval", "launcher", "placement", "recover")


def step_file(root: Path, step: int) -> Path:
    """Where step ``step``'s rollouts are (or go) under ``root``."""
    return root / f"step_{step:08d}.parquet"


def dumped_steps(root: Path) -> dict[int, Path]:
    """Step -> file of every complete step file under ``root`` (temporary files are not)."""
    found = {}
    for path in root.iterdir():
        match = STEP_NAME.fullmatch(path.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return found


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What tells two tokenizers apart: name, vocabulary size and a fingerprint of the vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return {"name_or_path": str(tokenizer.name_or_path), "vocab_size": len(tokenizer), "fingerprint": digest}


def config_hashes(cfg: RunConfig) -> dict[str, str]:
    """SHA-256 prefix of each configuration section that shapes training (``rollout`` without its
    ``dump`` and ``replay_from``), by section name."""
    plain = to_plain(cfg)
    plain["rollout"] = {k: v for k, v in plain["rollout"].items() if k not in ("dump", "replay_from")}
    return {
        key: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
        for key, value in sorted(plain.items())
        if key not in UNHASHED
    }


def _table(generations: Sequence[Generation]) -> Any:
    """The rows of ``generations`` as a pyarrow table (see the module docstring)."""
    import pyarrow as pa

    rows = [(g, s, i, gen) for g, gen in enumerate(generations) for i, s in enumerate(gen.samples)]
    samples: list[Sample] = [r[1] for r in rows]

    def per_row(fn: Callable[[Generation, int], Any]) -> list[Any]:
        return [fn(gen, i) for _, _, i, gen in rows]

    def texts(name: str) -> list[str]:
        return per_row(lambda gen, i: getattr(gen, name)[i] if getattr(gen, name) else "")

    columns: dict[str, Any] = {
        "generation": pa.array([r[0] for r in rows], pa.int32()),
        "group": pa.array(per_row(lambda gen, i: gen.group_index[i]), pa.int32()),
        "where": pa.array(texts("where"), pa.string()),
        "prompt_text": pa.array(texts("prompt_texts"), pa.string()),
        "response_text": pa.array(texts("response_texts"), pa.string()),
        "prompt_ids": pa.array([list(s.prompt_ids) for s in samples], pa.list_(pa.int32())),
        "response_ids": pa.array([list(s.response_ids) for s in samples], pa.list_(pa.int32())),
        "logprobs": pa.array([list(s.logprobs) for s in samples], pa.list_(pa.float32())),
        "weight_version": pa.array([s.weight_version for s in samples], pa.int64()),
        "token_weight_versions": pa.array([s.token_weight_versions for s in samples], pa.list_(pa.int64())),
        "token_mask": pa.array([s.token_mask for s in samples], pa.list_(pa.int8())),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "reward": pa.array(per_row(lambda gen, i: gen.rewards[i]), pa.float64()),
    }
    for name in dict.fromkeys(name for gen in generations for name in gen.reward_parts):
        columns[PART_PREFIX + name] = pa.array(
            per_row(lambda gen, i, name=name: gen.reward_parts[name][i] if name in gen.reward_parts else None),
            pa.float64(),
        )
    columns.update(
        {
            "workflow_reward": pa.array([s.reward for s in samples], pa.float64()),
            "turn_rewards": pa.array([s.turn_rewards for s in samples], pa.list_(pa.float64())),
            "turn_ends": pa.array([s.turn_ends for s in samples], pa.list_(pa.int32())),
            "info": pa.array([json.dumps(s.info, default=str) for s in samples], pa.string()),
            "routed_experts": pa.array([_flat_routes(s) for s in samples], pa.list_(pa.int16())),
            "route_shape": pa.array(
                [None if s.routed_experts is None else list(s.routed_experts.shape[1:]) for s in samples],
                pa.list_(pa.int32()),
            ),
        }
    )
    return pa.table(columns)


def _flat_routes(sample: Sample) -> list[int] | None:
    """A sample's routes as one flat list (``None`` without)."""
    routes = getattr(sample, "routed_experts", None)
    return None if routes is None else routes.reshape(-1).tolist()


def _routes(flat: list[int] | None, shape: list[int] | None) -> Any:
    """:func:`_flat_routes` back to an int16 tensor ``[tokens, L, K]`` (``None`` without)."""
    if flat is None or shape is None:
        return None
    import torch

    return torch.tensor(flat, dtype=torch.int16).reshape(-1, *shape)


def write_step(path: Path, header: Mapping[str, Any], generations: Sequence[Generation]) -> int:
    """Write ``generations`` (a step's generation batches) with ``header`` (completed here with
    the sample counts, metrics and largest token id) to ``path`` atomically; its size in bytes."""
    import pyarrow.parquet as pq

    table = _table(generations)
    ids = [t for gen in generations for s in gen.samples for t in (*s.prompt_ids, *s.response_ids)]
    full = {
        **header,
        "samples": table.num_rows,
        "max_token_id": max(ids, default=-1),
        "generations": [{"samples": len(gen.samples), "metrics": dict(gen.metrics)} for gen in generations],
    }
    table = table.replace_schema_metadata({HEADER_KEY: json.dumps(full, sort_keys=True).encode()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path.stat().st_size


def read_header(path: Path) -> dict[str, Any]:
    """The header of step file ``path``; ``ValueError`` when it is not a rollout dump."""
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    if HEADER_KEY not in metadata:
        raise ValueError("no core-rl rollout dump header")
    header = json.loads(metadata[HEADER_KEY])
    if header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format')!r}, not {FORMAT!r}")
    return header


def read_step(path: Path) -> tuple[dict[str, Any], list[Generation]]:
    """The header and the generation batches of step file ``path`` (what :func:`write_step` wrote;
    each generation's metrics as recorded)."""
    import pyarrow.parquet as pq

    header = read_header(path)
    columns = pq.read_table(path).to_pydict()
    parts = [name for name in columns if name.startswith(PART_PREFIX)]
    generations = [
        Generation(samples=[], group_index=[], rewards=[], metrics=dict(g["metrics"])) for g in header["generations"]
    ]
    for name in parts:
        for gen in generations:
            gen.reward_parts[name.removeprefix(PART_PREFIX)] = []
    for row in range(len(columns["generation"])):
        gen = generations[columns["generation"][row]]
        value = {name: columns[name][row] for name in columns}
        gen.samples.append(
            Sample(
                prompt_ids=value["prompt_ids"],
                response_ids=value["response_ids"],
                logprobs=value["logprobs"],
                weight_version=value["weight_version"],
                finish_reason=value["finish_reason"],
                token_weight_versions=value["token_weight_versions"],
                token_mask=value["token_mask"],
                reward=value["workflow_reward"],
                info=json.loads(value["info"]),
                turn_rewards=value["turn_rewards"],
                turn_ends=value["turn_ends"],
                routed_experts=_routes(value.get("routed_experts"), value.get("route_shape")),
            )
        )
        gen.group_index.append(value["group"])
        gen.rewards.append(value["reward"])
        gen.where.append(value["where"])
        gen.prompt_texts.append(value["prompt_text"])
        gen.response_texts.append(value["response_text"])
        for name in parts:
            gen.reward_parts[name.removeprefix(PART_PREFIX)].append(value[name])
    return header, generations


class RolloutDump:
    """Rank 0's recorder of ``rollout.dump``: :meth:`recording` wraps a step's source of
    generation batches and keeps what it returns on the steps due; :meth:`write` saves them."""

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer: Any) -> None:
        self.every = cfg.rollout.dump.every_n_steps
        self.root = Path(cfg.rollout.dump.dir) if cfg.rollout.dump.dir else run_dir / "rollouts"
        self.header: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "core_rl_version": __version__,
            "model_path": cfg.actor.model_path,
            "tokenizer": tokenizer_identity(tokenizer),
            "config_hash": config_hashes(cfg),
        }
        self._recorded: list[Generation] | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def recording(self, step: int, generate: Callable[[], Generation]) -> Callable[[], Generation]:
        """``generate``, keeping each generation batch it returns when step ``step`` is due."""
        self._recorded = None
        if not self.due(step):
            return generate
        recorded: list[Generation] = []
        self._recorded = recorded

        def recorded_generate() -> Generation:
            gen = generate()
            recorded.append(gen)
            return gen

        return recorded_generate

    def write(self, step: int) -> dict[str, float]:
        """Write what :meth:`recording` kept of step ``step``; ``rollout_dump/bytes`` and
        ``timing/rollout_dump_s`` (nothing on a step not due)."""
        if self._recorded is None:
            return {}
        t0 = time.perf_counter()
        header = {**self.header, "step": step, "weight_version": step - 1}
        size = write_step(step_file(self.root, step), header, self._recorded)
        self._recorded = None
        return {"rollout_dump/bytes": float(size), "timing/rollout_dump_s": time.perf_counter() - t0}
