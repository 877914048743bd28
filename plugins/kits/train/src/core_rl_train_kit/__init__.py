"""Building blocks every train engine plugin shares (imported by engines, never at registration):

- :mod:`.logprobs`: token log-probs and entropies from causal-LM logits, in the protocol's alignment;
- :mod:`.microbatch`: splitting a rank's rows into micro-batches;
- :mod:`.packing`: balanced grouping (first-fit-decreasing, Karmarkar-Karp) into micro-batches and
  across data-parallel ranks;
- :mod:`.packed`: the padded and packed (padding-free) micro-batch layouts and their forward;
- :mod:`.shared_prefix`: the shared layout (rows that begin with the same prompt run it once);
- :mod:`.runner`: the micro-batch loop (plan, forward, loss, backward, metrics) every engine runs;
- :mod:`.lora`: LoRA adapters through peft, merged exports and the adapter alone;
- :mod:`.buckets`: weights grouped into buckets of about a given size (weight sync);
- :mod:`.state`: training-state directories written by all ranks (atomic, no pickles);
- :mod:`.optim`: optimizer construction and the learning-rate schedule;
- :mod:`.distributed`: process-group set-up and the few collectives engines need;
- :mod:`.metrics`: per-step metric sums reduced over ranks;
- :mod:`.hf`: loading a Hugging Face causal LM from local files and writing one atomically.

An engine built on these honours the same :class:`core_rl.config.schema.ActorConfig` settings the
same way, which is what lets an algorithm run unchanged on any engine.
"""
