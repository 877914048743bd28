"""The ``reward`` section of ``reward_model`` (no torch import)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError, non_negative, one_of, positive


def _required(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value:
        raise FieldValueError(attribute.name, value, "required: a Hugging Face sequence-classification model directory")


def _template(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if "{response}" not in value:
        raise FieldValueError(attribute.name, value, "must contain {response} (and usually {prompt})")


@attrs.define
class RewardModelConfig:
    """See the package README. ``trust_remote_code``: let transformers run the Python files the
    model (or tokenizer) directory ships (an ``auto_map`` in its ``config.json`` /
    ``tokenizer_config.json``); without it such a directory is refused before the run
    (:meth:`check_environment`). This reward's own switch: it names its own directory."""

    model_path: str = attrs.field(default="", validator=_required)
    tokenizer_path: str | None = None
    template: str = attrs.field(default="{prompt}{response}", validator=_template)
    label_index: int = attrs.field(default=0, validator=non_negative())
    transform: str = attrs.field(default="none", validator=one_of(("none", "sigmoid")))
    batch_size: int = attrs.field(default=16, validator=positive())
    max_length: int = attrs.field(default=1024, validator=positive())
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16", "float16")))
    device: str = "cpu"
    trust_remote_code: bool = False

    def check_environment(self, context: Any) -> list[str]:
        """Before the run: a model or tokenizer directory that ships its own code needs
        ``trust_remote_code`` (:func:`core_rl.roles.remote_code.untrusted_code_problem`)."""
        from core_rl.roles import untrusted_code_problem

        problems = []
        for name in ("model_path", "tokenizer_path"):
            path = getattr(self, name)
            if path and Path(path).is_dir():
                problem = untrusted_code_problem(path, context.key(name), self.trust_remote_code)
                if problem is not None and problem not in problems:
                    problems.append(problem)
        return problems
