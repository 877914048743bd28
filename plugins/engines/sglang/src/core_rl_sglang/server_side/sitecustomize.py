"""Imported by Python at the start of every process of an SGLang server core-rl starts (this
directory is on its ``PYTHONPATH``): with ``CORE_RL_SGLANG_PINLESS=1`` (a CPU server serving LoRA
adapters) it applies :mod:`core_rl_sglang_pinless`. Runs in the sglang server environment."""

import os

if os.environ.get("CORE_RL_SGLANG_PINLESS") == "1":
    import core_rl_sglang_pinless

    core_rl_sglang_pinless.apply()
