"""TRL's side of ``benchmarks/trl_grpo.py``: its worker, run by that script (``--worker trl``) in
TRL's environment. Only the standard library and that script are imported at module level."""

from __future__ import annotations

import json
import time
from pathlib import Path

from trl_grpo import EPS_CLIP, GRAD_CLIP, LR, SEED, Workload, char_match, peak_device_mib, peak_rss_mib


def trl_worker(spec: dict) -> dict:
    """Train with TRL's ``GRPOTrainer`` (CPU, no vLLM); per-step timings from wrappers around its
    generation and log-prob methods and a callback at each step's start and end."""
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    wl = Workload(**spec["workload"])
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    if wl.real:  # conversational prompts: TRL renders them with the model's chat template
        rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def reward(completions: list, answer: list[str], **_: object) -> list[float]:
        # a conversational prompt's completion is its assistant message
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [char_match(c, a) for c, a in zip(texts, answer)]

    on_cuda = spec.get("device", "cpu") == "cuda"
    args = GRPOConfig(
        output_dir=str(Path(spec["work"]) / "trl-run"),
        use_cpu=not on_cuda,
        seed=SEED,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=GRAD_CLIP,
        per_device_train_batch_size=wl.prompts * wl.samples,
        gradient_accumulation_steps=1,
        num_generations=wl.samples,
        max_completion_length=wl.tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": wl.tokens},
        beta=0.0,
        **({} if spec.get("precision", "defaults") == "defaults" else {"bf16": spec["precision"] == "bf16"}),
        **(
            {}
            if spec.get("activation_checkpointing", "defaults") == "defaults"
            else {"gradient_checkpointing": spec["activation_checkpointing"] == "on"}
        ),
        epsilon=EPS_CLIP,
        loss_type="dapo",  # token-mean over the batch
        num_iterations=1,
        max_steps=spec["steps"],
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    phase = {"generate": 0.0, "logprobs": 0.0, "other": 0.0}
    in_scoring = [False]

    def timed(name: str, fn, only_in_scoring: bool = False):
        def wrapper(*a, **k):
            if only_in_scoring and not in_scoring[0]:
                return fn(*a, **k)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase[name] += time.perf_counter() - start

        return wrapper

    score = trainer._generate_and_score_completions

    cpu_rollout = [0.0]

    def scoring(*a, **k):
        in_scoring[0] = True
        start = time.process_time()
        try:
            return score(*a, **k)
        finally:
            in_scoring[0] = False
            cpu_rollout[0] += time.process_time() - start

    trainer._generate_and_score_completions = scoring
    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("other", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, only_in_scoring=True
    )
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            phase.update(generate=0.0, logprobs=0.0, other=0.0)
            cpu_rollout[0] = 0.0

        def on_step_end(self, *_a, **_k):
            if on_cuda:  # the step's kernels have run
                torch.cuda.synchronize()
            total, cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start
            # everything of the step outside generation, log-prob recomputation and rewards is its update
            step = {"step": total, "weight_sync": 0.0, **phase}
            step["train"] = total - phase["generate"] - phase["logprobs"] - phase["other"]
            step.update(cpu_step=cpu, cpu_rollout=cpu_rollout[0], cpu_update=cpu - cpu_rollout[0])
            steps.append(step)

    trainer.add_callback(Clock())
    trainer.train()
    return {"steps": steps, "peak_rss_mib": peak_rss_mib(), "peak_device_mib": peak_device_mib()}
