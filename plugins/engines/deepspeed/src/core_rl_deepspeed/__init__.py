"""core-rl-deepspeed: the ``deepspeed`` train engine (DeepSpeed ZeRO stages 1, 2 and 3 on Hugging Face
causal LMs).

The entry point ``deepspeed`` of ``core_rl.train_engines`` is :mod:`core_rl_deepspeed.plugin`; the
engine is :class:`core_rl_deepspeed.engine.DeepSpeedEngine`, its options
:class:`core_rl_deepspeed.config.DeepSpeedConfig`.
"""

__version__ = "0.1.0"
