"""core-rl-fsdp: the ``fsdp`` train engine (PyTorch FSDP2 ``fully_shard`` on Hugging Face causal LMs).

The entry point ``fsdp`` of ``core_rl.train_engines`` is :mod:`core_rl_fsdp.plugin`; the engine is
:class:`core_rl_fsdp.engine.FSDPEngine`, its options :class:`core_rl_fsdp.config.FSDPConfig`.
"""

__version__ = "0.1.0"
