"""core-rl-train-kit: the building blocks every train-engine plugin shares (imported by engines,
never at registration):

- :mod:`.runner`: the micro-batch loop (plan, forward, loss, backward, metrics) every engine runs;
- :mod:`.microbatch`, :mod:`.packing`: splitting a rank's rows into micro-batches
  (first-fit-decreasing, Karmarkar-Karp under a token budget);
- :mod:`.packed`, :mod:`.shared_prefix`: the padded and packed (padding-free) layouts and their
  forward, and the shared layout (rows that begin with the same prompt run it once);
- :mod:`.logprobs`, :mod:`.fused_head`, :mod:`.topk_logprobs`, :mod:`.topk_runner`: token
  log-probs, entropies and top-k from the logits, or from the hidden states without the logits;
- :mod:`.ulysses`, :mod:`.sharded_forward`: Ulysses sequence parallelism;
- :mod:`.optim`, :mod:`.muon`: optimizer construction and the learning-rate schedule;
- :mod:`.state`, :mod:`.export`: training-state directories written by all ranks (atomic, no
  pickles), and Hugging Face exports;
- :mod:`.attention`, :mod:`.row_pool`: the float32 attention for parity runs, rows pooled across ranks;
- :mod:`.moe`, :mod:`.moe_routing`: mixture-of-experts routers (routes recorded and replayed, routing
  metrics, the load-balancing loss) and an engine's routing replay on them;
- :mod:`.vision_tower`: a sharded vision tower's collectives kept in step across ranks.

What the core itself needs lives in the core and is public: rows to ranks (:mod:`core_rl.data.balance`),
process groups and collectives (:mod:`core_rl.launch.distributed`), Hugging Face loading and writing
(:mod:`core_rl.roles.hf`), LoRA through peft (:mod:`core_rl.roles.lora`), weight buckets
(:mod:`core_rl.sync.buckets`), token budgets (:mod:`core_rl.loops.token_budget`), per-step metric
sums (:mod:`core_rl.loops.step_metrics`).

An engine built on these honours the same :class:`core_rl.config.schema.ActorConfig` settings the
same way, which is what lets an algorithm run unchanged on any engine.
"""
