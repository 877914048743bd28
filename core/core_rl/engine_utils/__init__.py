"""Building blocks every train engine plugin shares (imported by engines, never at registration):

- :mod:`.logprobs`: token log-probs and entropies from causal-LM logits, in the protocol's alignment;
- :mod:`.microbatch`: splitting a rank's rows into micro-batches;
- :mod:`.optim`: optimizer construction and the learning-rate schedule;
- :mod:`.distributed`: process-group set-up and the few collectives engines need;
- :mod:`.metrics`: per-step metric sums reduced over ranks;
- :mod:`.hf`: loading a Hugging Face causal LM from local files and writing one atomically.

An engine built on these honours the same :class:`core_rl.config.schema.ActorConfig` settings the
same way, which is what lets an algorithm run unchanged on any engine.
"""
