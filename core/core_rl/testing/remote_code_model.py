"""A tiny model that ships its own modelling code, built offline (for tests of
``trust_remote_code``, :mod:`core_rl.roles.remote_code`).

:func:`build_remote_code_model` writes a directory as models with custom code are published: a
``configuration_tiny.py`` (a Llama configuration with the model type :data:`MODEL_TYPE`, which
transformers does not know), a ``modeling_tiny.py`` (a causal LM, a sequence and a token classifier
on it), ``config.json`` naming them through ``auto_map``, random weights in safetensors and the
character tokenizer of :mod:`core_rl.testing.tiny`. transformers can build this model only by running those
two files. :func:`make_remote_code` does the same to a directory already written (e.g. a reward
model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core_rl.testing.tiny import build_tiny_model

#: the model type of the custom configuration class (unknown to transformers)
MODEL_TYPE = "core_rl_tiny_remote"
#: the class names the code files define: the configuration, and per head (Llama's class name's
#: suffix) the model class
CONFIG_CLASS = "TinyRemoteConfig"
HEAD_CLASSES = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
}
MODEL_CLASS = "TinyRemoteForCausalLM"
#: ``config.json``'s ``auto_map``: each auto class and the ``module.Class`` transformers imports for it
AUTO_MAP = {
    "AutoConfig": f"configuration_tiny.{CONFIG_CLASS}",
    **{auto: f"modeling_tiny.TinyRemote{suffix}" for suffix, auto in HEAD_CLASSES.items()},
}

CONFIGURATION_CODE = f'''"""A Llama configuration under a model type of its own (a core-rl test model)."""

from transformers import LlamaConfig


class {CONFIG_CLASS}(LlamaConfig):
    model_type = "{MODEL_TYPE}"
'''

MODELING_CODE = f'''"""Models on {CONFIG_CLASS} (a core-rl test model): Llama's layers, classes of their own."""

from transformers import (
    AutoModel,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)

from .configuration_tiny import {CONFIG_CLASS}


class TinyRemoteModel(LlamaModel):
    config_class = {CONFIG_CLASS}


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = {CONFIG_CLASS}


class TinyRemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = {CONFIG_CLASS}

    def __init__(self, config):
        # the classifiers build their backbone with AutoModel.from_config; this file's model for
        # the configuration class the model is built with (transformers may load another copy)
        AutoModel.register(type(config), TinyRemoteModel, exist_ok=True)
        super().__init__(config)


class TinyRemoteForTokenClassification(LlamaForTokenClassification):
    config_class = {CONFIG_CLASS}

    def __init__(self, config):
        AutoModel.register(type(config), TinyRemoteModel, exist_ok=True)
        super().__init__(config)
'''


def make_remote_code(path: str | Path) -> Path:
    """Turn the Llama directory ``path`` (a causal LM or a sequence classifier, as saved by
    transformers) into one that needs its own code: write the code files and give ``config.json``
    the custom model type, class and :data:`AUTO_MAP`; the weights stay as they are."""
    path = Path(path)
    (path / "configuration_tiny.py").write_text(CONFIGURATION_CODE, encoding="utf-8")
    (path / "modeling_tiny.py").write_text(MODELING_CODE, encoding="utf-8")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    architectures = [name.replace("Llama", "TinyRemote", 1) for name in config.get("architectures", [])]
    config.update(model_type=MODEL_TYPE, architectures=architectures, auto_map=AUTO_MAP)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def build_remote_code_model(path: str | Path, **options: Any) -> Path:
    """Write the causal LM of the module docstring to ``path`` and return ``path``.
    ``options``: :func:`core_rl.testing.tiny.build_tiny_model`'s keyword arguments (Llama shapes, alphabet,
    seed)."""
    return make_remote_code(build_tiny_model(path, architecture="llama", **options))


def check_server_trust_flag(engine: Any, make_engine: Any, flag: str = "--trust-remote-code") -> None:
    """For a server-backed rollout engine (a :class:`~core_rl_server_kit.remote.ServerRolloutEngine` whose
    ``server_command`` can run without servers, e.g. made with ``__new__`` and its ``config``,
    ``options`` and ``model_path`` set): its registered factory ``make_engine`` takes
    ``trust_remote_code`` (default false), and the servers' command line holds ``flag`` once when the
    engine's ``trust_remote_code`` is set (as ``__init__`` sets it from ``actor.trust_remote_code``),
    before the user's ``extra_args``, and not otherwise."""
    import inspect

    assert inspect.signature(make_engine).parameters["trust_remote_code"].default is False
    assert flag not in engine.server_command("/env/bin/python", 8123, 0)  # the class default
    for trusted in (False, True):
        engine.trust_remote_code = trusted
        argv = engine.server_command("/env/bin/python", 8123, 0)
        assert argv.count(flag) == int(trusted), argv
        extra = list(engine.config.extra_args)
        assert argv[len(argv) - len(extra) :] == extra
