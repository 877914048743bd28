"""Step time and peak memory of the train engines, per engine and setting, printed as one table.

    python benchmarks/engines.py                 # ~10M-parameter Llama, 2 ranks, 3 timed steps
    python benchmarks/engines.py --nproc 1 --steps 5
    python benchmarks/engines.py --smoke         # tiny model, 1 rank, 1 step (the test runs this)

Every setting (FSDP full padded / packed / every rank loading the weights / LoRA / CPU offload,
DeepSpeed ZeRO-1/2/3 padded and packed, ZeRO-3 built without ``zero.Init``) runs in its own
``torchrun`` launch, on the same model and RL-like batch (32 rows of 16 prompt tokens and 8-112
response tokens, 2 micro-batches per rank).
Per setting: seconds per optimizer step (mean of the timed steps after one warm-up step), tokens per
second, the CPU seconds one rank spends per step (the maximum over ranks; on a loaded machine this,
not the wall time, shows the work), and memory, the maximum over ranks: on CPU the peak resident set
size of the process (``ru_maxrss``: torch and the libraries included) and the peak memory the
engine's construction added on a rank other than 0 (sampled every 2 ms: what memory-efficient
loading saves); on GPU the CUDA maximum allocated bytes.
``--smoke`` runs all settings in one launch instead (its memory columns then mean little).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: name -> (engine, engine options, actor overrides)
SETTINGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "fsdp full (padded)": ("fsdp", {}, {}),
    "fsdp full (packed)": ("fsdp", {}, {"layout": "packed"}),
    "fsdp full (all ranks load)": ("fsdp", {"load_on_rank0": False}, {}),
    "fsdp lora r16": ("fsdp", {}, {"lora": 16}),
    "fsdp cpu offload": ("fsdp", {"cpu_offload": True}, {}),
    "deepspeed zero1": ("deepspeed", {"zero_stage": 1}, {}),
    "deepspeed zero2": ("deepspeed", {"zero_stage": 2}, {}),
    "deepspeed zero3 (padded)": ("deepspeed", {"zero_stage": 3}, {}),
    "deepspeed zero3 (packed)": ("deepspeed", {"zero_stage": 3}, {"layout": "packed"}),
    "deepspeed zero3 (no zero.Init)": ("deepspeed", {"zero_stage": 3, "zero3_init": False}, {}),
}


def build_model(path: Path, *, smoke: bool) -> Path:
    from core_rl.testing.tiny import build_tiny_model

    if smoke:
        return build_tiny_model(path, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    # hidden 384, 6 layers, MLP 1024: ~10.6M parameters
    return build_tiny_model(
        path, hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024, max_position_embeddings=256
    )


# ------------------------------------------------------------------------------------------ worker


def current_rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest resident set size of this process while the ``with`` block runs (sampled every
    ``interval`` seconds by a thread)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = current_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def warm_up_imports() -> None:
    """Import what every setting needs before measuring, so no setting pays for the others' imports."""
    import core_rl_deepspeed.engine
    import core_rl_fsdp.engine
    import peft  # noqa: F401
    from core_rl_deepspeed.config import DeepSpeedConfig
    from transformers.models.llama import modeling_llama  # noqa: F401

    core_rl_deepspeed.engine.import_deepspeed(DeepSpeedConfig(), core_rl_fsdp.engine.dist_utils.pick_device())


def make_batch(rows: int, seed: int, *, vocab: int):
    import torch
    from core_rl.ops import aggregation_weights
    from core_rl.protocol import TensorBatch

    g = torch.Generator().manual_seed(seed)
    prompt, max_response = 16, 112
    response = torch.randint(8, max_response + 1, (rows,), generator=g)
    width = prompt + max_response
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    positions = torch.arange(width)[None]
    mask = (positions < prompt + response[:, None]).long()
    resp = ((positions >= prompt) & (mask == 1)).float()
    ids = ids * mask
    adv = torch.randn(rows, 1, generator=g) * resp
    return TensorBatch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "response_mask": resp,
            "old_logprobs": -torch.rand(rows, width, generator=g) * resp,
            "advantages": adv,
            "loss_weight": aggregation_weights(resp, "token-mean"),
        }
    )


def loss_fn(batch, logprobs, entropy):
    """The clipped policy-gradient loss (ratio to ``old_logprobs`` times the advantage)."""
    import torch
    from core_rl.interfaces import LossOutput

    ratio = torch.exp(logprobs - batch["old_logprobs"])
    adv = batch["advantages"]
    return LossOutput(per_token_loss=-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv))


def build_engine(name: str, model: str, rows: int):
    from core_rl.config.schema import ActorConfig, LoraConfig, MicroBatchConfig, OptimizerConfig, PluginSpec

    engine_name, options, overrides = SETTINGS[name]
    actor = ActorConfig(
        model_path=model,
        engine=PluginSpec(name=engine_name),
        optimizer=OptimizerConfig(name="adamw", lr=1e-5),
        # two micro-batches per rank: a quarter of the batch's padded tokens each (2 ranks)
        micro_batch=MicroBatchConfig(max_tokens_per_mb=rows * 128 // 4, layout=overrides.get("layout", "padded")),
        lora=LoraConfig(rank=overrides.get("lora", 0), alpha=32.0),
    )
    if engine_name == "fsdp":
        from core_rl_fsdp.config import FSDPConfig
        from core_rl_fsdp.engine import FSDPEngine

        return FSDPEngine(actor, FSDPConfig(**options), trainable=True)
    from core_rl_deepspeed.config import DeepSpeedConfig
    from core_rl_deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(actor, DeepSpeedConfig(**options), trainable=True)


def run_setting(name: str, model: str, steps: int, rows: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from core_rl.data.balance import rank_rows

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = current_rss()
    with PeakRSS() as during_build:
        engine = build_engine(name, model, rows)
    built = during_build.peak - baseline
    rank, world = engine.rank, engine.world_size
    times, cpu_times, tokens = [], [], 0.0
    for step in range(steps + 1):
        batch = make_batch(rows, seed=step, vocab=40)
        shard = batch.rows(rank_rows(batch, rank, world))
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = engine.train_step(shard, loss_fn)
        c1 = time.process_time()
        dist.barrier()
        if step > 0:  # the first step warms up (allocations, lazy optimizer state)
            times.append(time.perf_counter() - t0)
            cpu_times.append(c1 - c0)
            tokens += metrics["tokens"]
    # ZeRO-3 leaves each rank an empty placeholder per parameter: count ds_numel there
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.model.parameters() if p.requires_grad)
    engine.close()
    del engine
    gc.collect()
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu = statistics.fmean(cpu_times)
    stats = torch.tensor([peak / 2**20, built / 2**20 if rank != 0 or world == 1 else 0.0, cpu], dtype=torch.float64)
    if cuda:
        stats = stats.cuda()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {
        "setting": name,
        "step_s": statistics.fmean(times),
        "cpu_s": float(stats[2]),
        "tokens_per_s": tokens / sum(times),
        "peak_mib": float(stats[0]),
        "built_mib": float(stats[1]),
        "trainable_m": trainable / 1e6,
        "memory": "CUDA max allocated" if cuda else "peak RSS of the process",
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from core_rl.launch.distributed import ensure_process_group, pick_device

    torch.set_num_threads(1)
    ensure_process_group("auto", pick_device())
    warm_up_imports()
    rows = []
    for name in args.settings.split(","):
        rows.append(run_setting(name, args.model, args.steps, args.rows))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ driver


def format_table(rows: list[dict[str, Any]], *, world: int, params_m: float) -> str:
    head = (
        f"{'setting':30s} {'s/step':>8s} {'cpu s':>8s} {'tokens/s':>9s} {'peak MiB':>9s} {'build MiB':>9s} "
        f"{'trained M':>9s}"
    )
    lines = [f"engines on {world} rank(s), {params_m:.1f}M-parameter model; memory: {rows[0]['memory']}", head]
    for r in rows:
        lines.append(
            f"{r['setting']:30s} {r['step_s']:8.3f} {r['cpu_s']:8.3f} {r['tokens_per_s']:9.0f} {r['peak_mib']:9.1f} "
            f"{r['built_mib']:9.1f} {r['trainable_m']:9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes under torchrun)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per setting")
    parser.add_argument("--rows", type=int, default=32, help="rows of the global batch")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 rank, 1 step: checks it runs")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    if args.smoke:
        args.nproc, args.steps, args.rows = 1, 1, 8
    from core_rl.testing.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", smoke=args.smoke)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        h, n, i, v = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
        params_m = (n * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h) / 1e6
        settings = args.settings.split(",")
        launches = [",".join(settings)] if args.smoke else settings
        rows = []
        for i, launch in enumerate(launches):
            out = Path(tmp) / f"rows{i}.json"
            run_torchrun(
                Path(__file__),
                args.nproc,
                "--worker",
                f"--model={model}",
                f"--out={out}",
                f"--steps={args.steps}",
                f"--rows={args.rows}",
                f"--settings={launch}",
                timeout=3600,
            )
            rows += json.loads(out.read_text())
    print(format_table(rows, world=args.nproc, params_m=params_m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
