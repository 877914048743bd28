"""Imported by Python at the start of every process of an SGLang server core-rl starts (this
directory is on its ``PYTHONPATH``): with ``CORE_RL_SGLANG_PINLESS=1`` (a CPU server serving LoRA
adapters) it applies :mod:`core_rl_sglang_pinless`. The ``sitecustomize`` this one shadows, if the
server's Python has one further down ``sys.path``, still runs. Runs in the sglang server environment."""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed()
if os.environ.get("CORE_RL_SGLANG_PINLESS") == "1":
    import core_rl_sglang_pinless

    core_rl_sglang_pinless.apply()
