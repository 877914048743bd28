"""GRPO step time and device memory on one GPU, core-rl against TRL's ``GRPOTrainer`` (HF generate).

    python benchmarks/gpu_grpo.py [--shapes 0.5b,1.5b,0.5b-512,real] [--steps 5] [--tokens 256] [--rounds 2]
                                  [--core-rl-set KEY=VALUE ...] [--threads 8] [--no-trl] [--no-install]
                                  [--trl-python PATH] [--workdir DIR] [--timeout 1800] [--smoke]
                                  [--results PATH | --no-results] [--peak-tflops TFLOPS]

The workload: a random-weight Qwen2-shaped model (:data:`core_rl.testing.tiny.QWEN2_SHAPES`: ``0.5b`` is
Qwen2-0.5B's layout, hidden 896, intermediate 4864, 24 layers, 14 heads, 2 key/value heads, 0.36B
parameters with the character vocabulary; ``1.5b`` is Qwen2-1.5B's, 1.3B parameters, run where the
GPU's memory allows; ``0.5b-512`` is ``0.5b`` with 512-token responses), tied embeddings, a character
tokenizer over ``abcdefgh=``; ``real`` is the real pretrained SmolLM2-135M-Instruct
(``core_rl.testing.real_model``, on ``benchmarks/trl_grpo.py``'s addition questions in its chat
template, as that script's ``real`` workload; skipped where the model cannot be had); per step 8
prompts x 8 samples x ``--tokens`` tokens, 512 for ``0.5b-512`` (``min_new_tokens = max_new_tokens``,
so both sides generate every token); bf16 compute with fp32 master weights, no KL term and no
reference model, token-mean clipped loss, no gradient checkpointing, AdamW (lr 1e-5, grad clip 1.0),
rewards by ``char_match``: the settings of ``benchmarks/trl_grpo.py``, whose workers this script runs.

- core-rl: its defaults (``fsdp`` train engine, embedded ``hf`` rollout engine on the same GPU,
  ``weight_sync: memory``, its micro-batch budget), with bf16 mixed precision set as core-rl does it:
  ``actor.engine.param_dtype: bfloat16`` and ``reduce_dtype: float32`` (FSDP's mixed precision over
  fp32 weights) and ``rollout.engine.autocast_dtype: bfloat16`` (generation's matrix products in
  bfloat16 over fp32 weights). ``--core-rl-set`` overrides any key (as on ``core-rl train``'s command
  line), e.g. ``--core-rl-set actor.micro_batch.max_tokens_per_mb=16640``.
- TRL: ``GRPOTrainer`` with ``bf16=True`` (autocast over fp32 weights), ``use_vllm=False``,
  ``gradient_checkpointing=False``, ``loss_type="dapo"`` (token-mean), ``beta=0``.

Every run is a process of its own; runs alternate core-rl / TRL (the order flipping every round).
The table gives, per shape and side: the median step time over every step after each run's first
(``first``: the median first step, which pays warm-up), core-rl's split of it from its ``timing/*``
metrics (generate, log-prob recomputation, train, weight sync, other; TRL's from wrappers around its
generation and log-prob methods), the peak device memory (``torch.cuda.max_memory_allocated``: the
trainer, the rollout engine and their activations together) and the ratios to TRL.

After each shape's comparison table comes its bench card (``benchmarks/gpu_card.py``: s/step split
into generate, train, sync and other, generated and training tokens/s, the update's FLOPs and MFU
against the device's peak dense bf16 FLOP/s, ``--peak-tflops`` where the device is not in its table,
peak memory), and core-rl's row of it is appended to ``--results`` (``benchmarks/results/gpu.md``;
``benchmarks/gpu_results.py``) with the date, device, versions and commit, flagged where it regressed
by more than 5% against the last row of the same device and shape (a line per flag is printed). The
card is the default output, not a flag: a GPU run is rare and costly, and a run that leaves no row
is one the next run cannot be compared with; ``--no-results`` keeps an experiment (e.g. with
``--core-rl-set``) out of the file. With ``--smoke`` the rows go to ``WORKDIR/gpu.md`` unless
``--results`` names a file, so the CPU check never writes into the repository's.

Where TRL comes from: ``--trl-python PATH``; else this interpreter when it imports ``trl`` (on a GPU
machine without a package index: carry TRL in the offline wheelhouse with
``python3 scripts/offline/build_wheelhouse.py OUT --have have.txt --with trl==1.16.0`` and install it
with ``scripts/offline/install.sh OUT``); else its own environment under
``$CORE_RL_HOME/server-envs/``, built on first use where an index is reachable: on a GPU machine it
sees this interpreter's CUDA torch (a ``.pth`` line) and installs only TRL and what torch does not
cover; with ``--smoke``, ``benchmarks/trl_grpo.py``'s CPU environment. ``--no-install`` never builds
one, ``--no-trl`` runs core-rl alone.

Without CUDA the script refuses in one line, unless ``--smoke``: a tiny model, 1 step of each side
on the CPU (the test suite runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_card  # this folder's bench card: FLOPs, MFU and the card's table
import gpu_results  # the card's results file and its regression rule
import trl_grpo  # this folder's TRL benchmark: its workers, prompts and reward

PROMPTS, SAMPLES = 8, 8
#: the tiny model of ``--smoke`` and its per-step shape
SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
SMOKE_PROMPTS, SMOKE_SAMPLES, SMOKE_TOKENS = 2, 4, 8
#: core-rl's bf16 mixed precision over fp32 weights (the trainer's FSDP policy; autocast off there)
CORE_RL_ACTOR = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "autocast_dtype": None}
#: GPU memory a shape needs, per parameter: fp32 weights, gradients and AdamW's two moments (16 bytes),
#: the rollout engine's fp32 copy (4), and room for activations and the allocator (4)
BYTES_PER_PARAM = 24
TRL_ENV = "bench-trl-gpu"
#: the shapes: a layout of ``core_rl.testing.tiny.QWEN2_SHAPES`` (``None``: the real model) and the
#: response tokens (``None``: ``--tokens``)
SHAPES: dict[str, tuple[str | None, int | None]] = {
    "0.5b": ("0.5b", None),
    "1.5b": ("1.5b", None),
    "0.5b-512": ("0.5b", 512),
    "real": (None, None),
}
#: the repository's results file of the bench card
RESULTS = Path(__file__).resolve().parent / "results" / "gpu.md"


def model_params(shape: dict) -> int:
    """Parameters of a Qwen2 layout with tied embeddings and the benchmark's vocabulary (4 special
    tokens and one per character): the projections (q, k, v with biases, o), MLP and norms of every
    layer, the embeddings and the final norm."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    kv = h // shape["num_heads"] * shape["num_kv_heads"]
    layer = 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * i + 2 * h
    vocab = 4 + len(trl_grpo.LETTERS + "=")
    return n * layer + vocab * h + h


def prepare(work: Path, name: str, shape: dict, tokens: int, prompts: int, steps: int) -> tuple[Path, Path]:
    """The model directory and prompt file of one shape under ``work`` (a model built before is reused)."""
    from core_rl.testing.tiny import build_tiny_model

    model = work / "model"
    if not (model / "config.json").is_file():
        print(f"  building the {name} model in {model}", flush=True)
        build_tiny_model(
            model,
            alphabet=trl_grpo.LETTERS + "=",
            max_position_embeddings=tokens + 64,
            seed=trl_grpo.SEED,
            architecture="qwen2",
            tie_word_embeddings=True,
            **shape,
        )
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in trl_grpo.prompt_rows(prompts * steps)), encoding="utf-8")
    return model, data


# -------------------------------------------------------------------------------------------- TRL


def trl_env_spec():
    """TRL in an environment that sees this interpreter's torch (a ``.pth`` line naming the folder
    torch is installed in), so a GPU machine's CUDA build is used, not downloaded again. Installed
    with pip: uv does not look at ``.pth`` folders and would fetch torch."""
    import torch
    from core_rl.interfaces.servers import ServerEnvSpec

    site = str(Path(torch.__file__).resolve().parents[1])
    purelib = "pathlib.Path(sysconfig.get_paths()['purelib'], 'base_torch.pth')"
    pth = f"import pathlib, sysconfig; {purelib}.write_text({site!r})"
    steps = [["-c", pth], ["-m", "pip", "install", "-q", f"trl=={trl_grpo.TRL_VERSION}"]]
    return ServerEnvSpec(
        name=TRL_ENV,
        steps={"cuda": steps, "cpu": steps},
        check="import trl, torch; print(trl.__version__, torch.__version__, torch.cuda.is_available())",
        description=f"TRL {trl_grpo.TRL_VERSION} over the trainer's torch, for benchmarks/gpu_grpo.py",
    )


def trl_python(args: argparse.Namespace, on_cuda: bool) -> tuple[str | None, str]:
    """``(interpreter, where it comes from)``, or ``(None, why there is none)``."""
    if args.no_trl:
        return None, "--no-trl"
    if args.trl_python:
        return args.trl_python, "--trl-python"
    if importlib.util.find_spec("trl") is not None:
        return sys.executable, "this environment"
    if not on_cuda:
        found = trl_grpo.trl_python(install=not args.no_install)
        return (str(found), "benchmarks/trl_grpo.py's environment") if found else (None, "its environment is not built")
    from core_rl_server_kit import env as server_env

    spec = trl_env_spec()
    directory = server_env.find(spec, variant="cuda")
    if directory is None and not args.no_install:
        os.environ[server_env.INSTALLER_ENV] = "pip"  # see trl_env_spec (this process builds nothing else)
        try:
            directory = server_env.create(spec, variant="cuda", echo=print)
        except server_env.ServerEnvError as exc:
            return None, f"building its environment failed ({str(exc).splitlines()[0]})"
    if directory is None:
        return None, "its environment is not built"
    return str(server_env.env_python(directory)), str(directory)


# ------------------------------------------------------------------------------------------ runs


def run_side(python: str, kind: str, spec: dict, timeout: float, log: Path) -> dict | str:
    """One run's result, or, if it failed or ran past ``timeout``, the last line of its error (e.g.
    CUDA out of memory) with the path of ``log``, where the whole error (the worker's output) goes."""
    try:
        return trl_grpo.run_worker(python, kind, spec, timeout)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        text = str(exc)
        if isinstance(exc, subprocess.TimeoutExpired):
            text += "\n" + "\n".join(_text(part) for part in (exc.stdout, exc.stderr) if part)
        log.write_text(text)
        lines = [li for li in text.splitlines() if li.strip()]
        oom = [li for li in lines if "out of memory" in li.lower()]
        return f"{(oom or lines or ['failed'])[-1][:160]} (log: {log})"


def _text(output: bytes | str) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def summary(results: list[dict], on_cuda: bool) -> dict | None:
    """Medians of the runs (:func:`trl_grpo.summarise`) and the largest peak memory (of the device,
    or resident on the CPU), in GiB."""
    if not results:
        return None
    s = trl_grpo.summarise(results)
    peak = max(r["peak_device_mib"] for r in results) if on_cuda else s.peak_rss_mib
    return {"step": s.step, "first": s.first_step, "split": s.split, "peak_gib": peak / 1024, "runs": s.runs}


def print_table(rows: list[tuple[str, dict[str, dict | None]]], memory: str) -> None:
    head = f"{'shape':<24}{'side':<9}{'s/step':>8}{'first':>7}{'generate':>9}{'logprobs':>9}{'train':>7}"
    head += f"{'sync':>7}{'other':>7}{'peak GiB':>9}{'time vs TRL':>12}{'mem vs TRL':>11}"
    print(f"\n(peak: {memory}; medians over the steps after each run's first)\n{head}\n{'-' * len(head)}")
    for label, sides in rows:
        trl = sides.get("trl")
        for kind, s in sides.items():
            if s is None:
                print(f"{label:<24}{kind:<9}{'failed':>8}")
            else:
                sp = s["split"]
                ratio = f"{s['step'] / trl['step']:.2f}x" if trl else "-"
                mem = f"{s['peak_gib'] / trl['peak_gib']:.2f}x" if trl else "-"
                print(
                    f"{label:<24}{kind:<9}{s['step']:>8.3f}{s['first']:>7.1f}{sp['generate']:>9.3f}"
                    f"{sp['logprobs']:>9.3f}{sp['train']:>7.3f}{sp['weight_sync']:>7.3f}{sp['other']:>7.3f}"
                    f"{s['peak_gib']:>9.2f}{ratio:>12}{mem:>11}"
                )
            label = ""


def card_shape(model: Path, data: Path, workload: trl_grpo.Workload, steps: int) -> gpu_card.Shape:
    """The FLOP count's inputs for one shape: the parameters (the model file's tensors), layers and
    hidden size (its ``config.json``), and per step the samples, response tokens and prompt tokens:
    every prompt of ``data`` encoded as core-rl encodes it (``data.apply_chat_template`` for the real
    model), counted once per sample, the sum over the run divided by its ``steps``."""
    from core_rl.config.data_config import DataConfig
    from core_rl.data.prompts import encode_prompt
    from transformers import AutoTokenizer

    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    data_config = DataConfig(apply_chat_template=workload.real)
    prompt_tokens = sum(len(encode_prompt(r["prompt"], data_config, tokenizer)[0]) for r in rows)
    return gpu_card.Shape(
        params=trl_grpo.param_count(model),
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        samples=workload.prompts * workload.samples,
        response_tokens=workload.tokens,
        prompt_tokens=round(workload.samples * prompt_tokens / steps),
    )


def shape_label(name: str, params: int, prompts: int, samples: int, tokens: int) -> str:
    """A shape as the tables and the results file name it: ``0.5b 0.36B 8x8x256``."""
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    return f"{name} {size} {prompts}x{samples}x{tokens}"


def git_commit() -> str:
    """This checkout's ``git rev-parse --short HEAD``, with ``+dirty`` when tracked files have
    uncommitted changes; ``unknown`` without git."""
    root = str(Path(__file__).resolve().parents[1])
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        status = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.returncode == 0 and status.stdout.strip() else "")


def run_info(device: str) -> dict[str, str]:
    """The columns of a results row that describe the run: date (UTC), device, versions, commit."""
    import datetime

    import torch
    import transformers

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
    }


def results_row(info: dict[str, str], shape: str, c: gpu_card.Card) -> dict[str, str]:
    """A row of the results file (``gpu_results.FIELDS`` but ``flags``) for core-rl's card."""
    return {
        **info,
        "shape": shape,
        "s/step": f"{c.step:.3f}",
        "generate": f"{c.generate:.3f}",
        "train": f"{c.train:.3f}",
        "sync": f"{c.sync:.3f}",
        "other": f"{c.other:.3f}",
        "gen tok/s": f"{c.gen_tps:.0f}",
        "train tok/s": f"{c.train_tps:.0f}",
        "TFLOP/step": f"{c.tflop:.4g}",
        "MFU %": "unknown" if c.mfu is None else f"{100 * c.mfu:.2f}",
        "peak GiB": f"{c.peak_gib:.2f}",
    }


def main(argv: list[str] | None = None) -> int:
    from core_rl.testing.tiny import QWEN2_SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion (min = max)")
    trl_grpo.add_run_options(parser, steps=5, threads=min(8, os.cpu_count() or 1))
    parser.add_argument("--trl-python", default=None, help="the interpreter of an environment with TRL")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 step of each side, on the CPU")
    parser.add_argument(
        "--results", default=None, help=f"the bench card's results file (default {RESULTS}; --smoke: WORKDIR/gpu.md)"
    )
    parser.add_argument("--no-results", action="store_true", help="print the bench card, append no row")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s (default: its table)"
    )
    args = parser.parse_args(argv)

    import torch

    on_cuda = torch.cuda.is_available() and not args.smoke
    if not on_cuda and not args.smoke:
        print(
            "gpu_grpo: no CUDA GPU here (torch.cuda.is_available() is False); --smoke runs a tiny CPU check",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        shapes: dict[str, tuple[dict | None, int]] = {"tiny": (SMOKE, SMOKE_TOKENS)}
        args.steps, args.rounds, args.tokens, args.threads = 1, 1, SMOKE_TOKENS, 1
        prompts, samples = SMOKE_PROMPTS, SMOKE_SAMPLES
    else:
        names = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in names if s not in SHAPES]
        if unknown:
            parser.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
        shapes = {}
        for s in names:
            layout, tokens = SHAPES[s]
            shapes[s] = (QWEN2_SHAPES[layout] if layout else None, tokens or args.tokens)
        prompts, samples = PROMPTS, SAMPLES
    device = torch.cuda.get_device_properties(0) if on_cuda else None
    device_name = device.name if device else "cpu"
    peak = gpu_card.peak_tflops(device_name, args.peak_tflops)
    python, source = trl_python(args, on_cuda)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="core-rl-gpu-bench-"))
    results = None if args.no_results else Path(args.results or (root / "gpu.md" if args.smoke else RESULTS))
    info = run_info(device_name)
    where = f"{device.name} ({device.total_memory / 2**30:.0f} GiB)" if device else "CPU (--smoke)"
    print(
        f"GRPO on {where}: {prompts} prompts x {samples} samples x {args.tokens} tokens"
        f"{' (512 for 0.5b-512)' if '0.5b-512' in shapes else ''}, "
        f"{args.steps} steps per run, {args.rounds} round(s); "
        f"TRL: {source if python else f'none ({source}): core-rl only'}; work dir {root}; "
        f"results {results or 'none (--no-results)'}; commit {info['commit']}",
        flush=True,
    )
    rows = []
    flagged = 0
    for name, (shape, tokens) in shapes.items():
        work = root / name
        workload = trl_grpo.Workload(
            name=name,
            hidden=shape["hidden_size"] if shape else 0,
            layers=shape["num_layers"] if shape else 0,
            heads=shape["num_heads"] if shape else 0,
            intermediate=shape["intermediate_size"] if shape else 0,
            prompts=prompts,
            samples=samples,
            tokens=tokens,
            real=shape is None,
        )
        if shape is None:
            from core_rl.testing.real_model import unavailable

            why = unavailable()
            if why is not None:
                print(f"  {name}: skipped, the real model is not to be had here ({why.splitlines()[0]})")
                continue
            model, data = trl_grpo.prepare(work, workload, args.steps)
        else:
            params = model_params(shape)
            if device is not None and params * BYTES_PER_PARAM > device.total_memory:
                print(f"  {name}: skipped, needs about {params * BYTES_PER_PARAM / 2**30:.0f} GiB of GPU memory")
                continue
            work.mkdir(parents=True, exist_ok=True)
            model, data = prepare(work, name, shape, tokens, prompts, args.steps)
        counted = card_shape(model, data, workload, args.steps)
        label = shape_label(name, counted.params, prompts, samples, tokens)
        spec = {
            "work": str(work),
            "model": str(model),
            "data": str(data),
            "workload": asdict(workload),
            "steps": args.steps,
            "threads": args.threads,
            "activation_checkpointing": "off",
            "precision": "bf16",
            "device": "cuda" if on_cuda else "cpu",
            # --smoke stays on the CPU on a GPU machine too
            "actor_engine": {**CORE_RL_ACTOR, **({} if on_cuda else {"device": "cpu"})},
            "rollout_engine": {} if on_cuda else {"device": "cpu"},
            "cli_overrides": args.core_rl_set,
        }
        sides = [("core-rl", sys.executable)] + ([("trl", python)] if python else [])
        runs: dict[str, list[dict]] = {kind: [] for kind, _ in sides}
        for r in range(args.rounds):
            for kind, py in sides if r % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                out = run_side(py, kind, spec, args.timeout, work / f"{kind}-round{r + 1}.log")
                took = time.perf_counter() - start
                if isinstance(out, str):
                    print(f"  {name} round {r + 1} {kind}: failed after {took:.0f} s: {out}", flush=True)
                else:
                    runs[kind].append(out)
                    steps = statistics.median(s["step"] for s in out["steps"])
                    print(f"  {name} round {r + 1} {kind}: {took:.0f} s ({steps:.3f} s/step)", flush=True)
        summaries = {kind: summary(v, on_cuda) for kind, v in runs.items()}
        rows.append((label, summaries))
        # the table so far after each shape: a run stopped by a time limit keeps what it measured
        print_table(rows, "torch.cuda.max_memory_allocated" if on_cuda else "resident set size, CPU")
        flagged += bench_card(label, device_name, peak, counted, summaries, info, results, args.core_rl_set)
    failed = [f"{label.split()[0]} {kind}" for label, sides in rows for kind, s in sides.items() if s is None]
    if failed:
        print(f"gpu_grpo: every run failed for: {', '.join(failed)}", file=sys.stderr)
    if flagged:
        print(f"gpu_grpo: {flagged} regression(s) flagged in {results}")
    if python is None and not args.no_trl and not args.smoke:
        print(f"gpu_grpo: no TRL to compare with ({source}); --no-trl to run core-rl alone", file=sys.stderr)
        return 1
    return 1 if failed else 0


def bench_card(
    label: str,
    device: str,
    peak: float | None,
    shape: gpu_card.Shape,
    summaries: dict[str, dict | None],
    info: dict[str, str],
    results: Path | None,
    overrides: list[str],
) -> int:
    """Print one shape's bench card (the sides that ran), append core-rl's row to ``results`` (if
    given and core-rl ran; its shape the label and the ``--core-rl-set`` ``overrides``) and print a
    line per regression flagged; returns how many."""
    cards = {kind: gpu_card.card(s, shape, peak) for kind, s in summaries.items() if s is not None}
    if not cards:
        return 0
    print("\n" + gpu_card.card_table(label, device, peak, shape, cards), flush=True)
    if results is None or "core-rl" not in cards:
        return 0
    # a run with --core-rl-set overrides is its own shape: compared only with runs of the same ones
    key = " ".join([label, *overrides])
    row = results_row(info, key, cards["core-rl"])
    flags = gpu_results.append(results, row)
    print(f"  row appended to {results}: {device}, {key}, commit {info['commit']}")
    for flag in flags:
        print(
            f"gpu_grpo: REGRESSION on {device}, {key}: {flag.figure} {flag.previous:g} -> {flag.new:g} "
            f"({100 * flag.change:+.1f}%, beyond {100 * gpu_results.THRESHOLD:.0f}%)"
        )
    return len(flags)


if __name__ == "__main__":
    sys.exit(main())
