"""core-rl-megatron: the ``megatron`` train engine (Megatron-core ``GPTModel`` built from Hugging
Face Llama / Qwen2 / Qwen3 checkpoints, with tensor, pipeline, virtual-pipeline and context
parallelism).

The entry point ``megatron`` of ``core_rl.train_engines`` is :mod:`core_rl_megatron.plugin`; the
engine is :class:`core_rl_megatron.engine.MegatronEngine`, its options
:class:`core_rl_megatron.config.MegatronConfig`.
"""

__version__ = "0.1.0"
