"""The ``shared`` micro-batch layout against ``padded`` on SmolLM2-135M-Instruct (issue 52's GRPO
workload on a CPU): the fsdp engine's ``train_step`` and ``compute_logprobs`` times of the same
batch, the two layouts interleaved.

    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py                # 8 prompts x 4 samples x 32 tokens
    OMP_NUM_THREADS=1 python benchmarks/shared_prefix.py --repeats 1 --prompts 2

The prompts are chat-templated questions (~45 tokens with SmolLM2's template and system prompt),
the responses random tokens (32 each), the loss a policy-gradient one (``-advantage x log-prob``
with an entropy bonus). One rank, float32, ``max_tokens_per_mb: auto`` (768 on a CPU), AdamW.
Prints per layout the micro-batches, the tokens the model runs (stream tokens in the shared
layout) and the seconds of each timed call (after one warm-up step each).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is 17 * 23? Show your work step by step.",
    "Name three prime numbers greater than 50 and explain why each is prime.",
    "A train leaves at 3 pm and travels 120 km at 80 km/h. When does it arrive?",
    "Write a short poem about the sea, in four lines.",
    "If a rectangle has a perimeter of 30 and a width of 5, what is its area?",
    "Explain in two sentences why the sky is blue.",
    "Sort these numbers from smallest to largest: 42, 7, 19, 88, 3.",
    "How many minutes are there in a week? Give only the number.",
]


def grpo_batch(model_path: Path, prompts: int, samples: int, new_tokens: int, seed: int = 0):
    from core_rl.ops import aggregation_weights
    from core_rl.testing.helpers import right_padded
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for question in (QUESTIONS * (prompts // len(QUESTIONS) + 1))[:prompts]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for _ in range(samples):
            rows.append((prompt + torch.randint(100, 40_000, (new_tokens,), generator=g).tolist(), len(prompt)))
    batch = right_padded(rows, tokenizer.pad_token_id)
    resp = batch["response_mask"]
    batch["advantages"] = torch.randn(len(rows), 1, generator=g) * resp
    batch["loss_weight"] = aggregation_weights(resp, "token-mean", norm_length=new_tokens)
    prompt_lens = sorted({p for _, p in rows})
    return batch, prompt_lens


def pg_loss(batch, logprobs, entropy):
    from core_rl.interfaces import LossOutput

    return LossOutput(per_token_loss=-batch["advantages"] * logprobs - 0.01 * entropy * batch["response_mask"])


def stream_tokens(engine, batch) -> tuple[int, int]:
    """Micro-batches and the tokens the model runs for ``batch`` in the engine's plan."""
    from core_rl_train_kit.microbatch import micro_batch_width
    from core_rl_train_kit.shared_prefix import share_rows

    runner = engine.runner
    lengths, plan = runner.plan(batch)
    tokens = 0
    for mb in plan:
        if mb.units is None:
            tokens += len(mb.rows) * micro_batch_width(lengths, mb.rows)
        else:
            width = micro_batch_width(lengths, mb.rows)
            stream = share_rows(batch["input_ids"][mb.rows, :width], batch["attention_mask"][mb.rows, :width], mb.units)
            tokens += stream.input_ids.numel()
    return len(plan), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="padded,shared")
    args = parser.parse_args()

    from core_rl.config.schema import ActorConfig, MicroBatchConfig, OptimizerConfig, PluginSpec
    from core_rl.launch.distributed import ensure_process_group
    from core_rl.testing import real_model
    from core_rl_fsdp.config import FSDPConfig
    from core_rl_fsdp.engine import FSDPEngine

    torch.set_num_threads(1)
    ensure_process_group("gloo", torch.device("cpu"))
    path = real_model.smollm2()
    batch, prompt_lens = grpo_batch(path, args.prompts, args.samples, args.new_tokens)
    real = int(batch["attention_mask"].sum())
    print(f"{batch.batch_size} rows, prompts of {prompt_lens} tokens, {real} real tokens")
    layouts = args.layouts.split(",")
    engines = {}
    for layout in layouts:
        actor = ActorConfig(
            model_path=str(path),
            engine=PluginSpec(name="fsdp"),
            optimizer=OptimizerConfig(name="adamw", lr=1e-6),
            micro_batch=MicroBatchConfig(layout=layout),
        )
        engines[layout] = FSDPEngine(actor, FSDPConfig(), trainable=True)
        count, tokens = stream_tokens(engines[layout], batch)
        print(f"{layout}: runner layout {engines[layout].runner.layout}, {count} micro-batches, {tokens} tokens")
    calls = ("train_step", "train_step cpu", "compute_logprobs", "compute_logprobs cpu")
    times: dict[str, dict[str, list[float]]] = {layout: {what: [] for what in calls} for layout in layouts}
    for layout in layouts:  # warm-up
        engines[layout].train_step(batch, pg_loss)
    for _ in range(args.repeats):
        for layout in layouts:
            engine = engines[layout]
            start, cpu = time.perf_counter(), time.process_time()
            metrics = engine.train_step(batch, pg_loss)
            times[layout]["train_step"].append(time.perf_counter() - start)
            times[layout]["train_step cpu"].append(time.process_time() - cpu)
            start, cpu = time.perf_counter(), time.process_time()
            engine.compute_logprobs(batch)
            times[layout]["compute_logprobs"].append(time.perf_counter() - start)
            times[layout]["compute_logprobs cpu"].append(time.process_time() - cpu)
            print(
                f"  {layout}: train_step {times[layout]['train_step'][-1]:.2f} s (loss {metrics['loss']:.4f}), "
                f"compute_logprobs {times[layout]['compute_logprobs'][-1]:.2f} s "
                f"(cpu {times[layout]['train_step cpu'][-1]:.2f} s, {times[layout]['compute_logprobs cpu'][-1]:.2f} s)",
                flush=True,
            )
    for layout in layouts:
        for what, values in times[layout].items():
            print(
                f"{layout:>7} {what:>16}: mean {statistics.mean(values):.2f} s, min {min(values):.2f} s, "
                f"runs {[round(v, 2) for v in values]}"
            )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
