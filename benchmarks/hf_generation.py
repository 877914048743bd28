"""Generation of the ``hf`` rollout engine against transformers' ``model.generate``.

The workload of ``gpu_grpo.py``'s rollout: a random-weight Qwen2-shaped model
(:data:`core_rl.testing.tiny.QWEN2_SHAPES`, default ``0.5b``: Qwen2-0.5B's layers, 0.36B parameters with the
character vocabulary), ``--prompts`` prompts x ``--n`` samples of exactly ``--tokens`` tokens
(``min_new_tokens`` = ``max_new_tokens``, temperature 1), weights in ``--dtype``. Each row generates
once untimed (warm-up; the engine's CUDA graph capture happens there and is printed), then
``--repeats`` timed times; it prints seconds per generation (median) and generated tokens/s:

- ``transformers``: ``model.generate`` (sampling, dynamic cache, eager);
- ``hf eager``: the engine with ``cuda_graphs: false`` (every kernel launched from Python);
- ``hf graphs``: the engine with ``cuda_graphs: true`` (CUDA only).

    python benchmarks/hf_generation.py [--shape 0.5b] [--prompts 8] [--n 8] [--tokens 256]
                                       [--dtype bfloat16] [--repeats 3] [--workdir DIR]

Without CUDA the script refuses in one line, unless ``--smoke``: a tiny model on the CPU, one
repeat, no graphs (the test suite runs it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_grpo  # the GPU GRPO benchmark: its model shapes and builder
import trl_grpo  # its prompts


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed call."""

    def once() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def transformers_row(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device):
    from core_rl_hf.generation import left_pad
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    pad = model.generation_config.pad_token_id or 0
    input_ids, mask, _ = left_pad(prompts, pad, device)

    def run() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                num_return_sequences=args.n,
                pad_token_id=pad,
            )

    return timed(run, args.repeats, device), ""


def engine_row(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, graphs: bool):
    from core_rl.interfaces import SamplingParams
    from core_rl_hf.config import HFRolloutConfig
    from core_rl_hf.engine import HFRolloutEngine

    config = HFRolloutConfig(dtype=args.dtype, device=args.device, seed=0, cuda_graphs=graphs)
    engine = HFRolloutEngine(model_dir, config)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    try:
        seconds = timed(lambda: engine.generate(prompts, sampling), args.repeats, engine.device)
        note = ""
        if engine.graphs is not None:
            note = f"{engine.graphs.captures} capture(s), {engine.graphs.capture_seconds:.2f} s once"
    finally:
        engine.close()
    return seconds, note


def main(argv: list[str] | None = None) -> int:
    from core_rl.testing.tiny import QWEN2_SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.5b", choices=sorted(QWEN2_SHAPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", help="where the model is built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, one repeat (the test suite's)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("hf_generation.py needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs a tiny CPU check")
        return 2
    shape = QWEN2_SHAPES[args.shape]
    if args.smoke:
        shape, args.prompts, args.n, args.tokens, args.repeats = gpu_grpo.SMOKE, 2, 4, 8, 1
        args.dtype = "float32"
    args.device = "cuda" if cuda and not args.smoke else "cpu"
    device = torch.device(args.device)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="core-rl-hfgen-"))
    name = "tiny" if args.smoke else args.shape
    model_dir, _ = gpu_grpo.prepare(work, name, shape, args.tokens, args.prompts, 1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in trl_grpo.prompt_rows(args.prompts)]
    tokens = args.prompts * args.n * args.tokens
    print(
        f"{name} model, {args.prompts} prompts x {args.n} samples x {args.tokens} tokens, {args.dtype}, "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}",
        flush=True,
    )
    rows = [("transformers", lambda: transformers_row(model_dir, prompts, args, device))]
    rows.append(("hf eager", lambda: engine_row(model_dir, prompts, args, graphs=False)))
    if device.type == "cuda":
        rows.append(("hf graphs", lambda: engine_row(model_dir, prompts, args, graphs=True)))
    print(f"{'generator':<14} {'s/generation':>12} {'tokens/s':>10} {'vs transformers':>16}  note")
    base = None
    for label, run in rows:
        seconds, note = run()
        base = base or seconds
        print(f"{label:<14} {seconds:>12.3f} {tokens / seconds:>10.0f} {base / seconds:>15.2f}x  {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
