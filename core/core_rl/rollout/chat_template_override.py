"""A chat template for the run other than the tokenizer's own (``data.chat_template``): a Jinja
template, or the path of a file holding one (``.jinja``; relative to the working directory).

Before anything loads the policy's tokenizer, :func:`apply_chat_template_override` makes
``<run>/chat_template/tokenizer``: the tokenizer of ``actor.tokenizer_path`` (default: the model
directory) saved with that template (and its own code files, for a tokenizer that ships code).
``actor.tokenizer_path`` then names that directory, so every part of the run renders chats the same
way (prompts with ``data.apply_chat_template``, evaluation prompts, SFT conversations) and every
export (``final_hf``, ``hf/step_<N>``) carries the template, so the trained model is served with the
format it learned. The run's ``config.yaml`` keeps the written path, noting the derived one. The
template must render a one-message conversation with a generation prompt, checked then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from core_rl.config.derived import record
from core_rl.config.derived_key import Derived
from core_rl.config.schema import RunConfig
from core_rl.roles.derived_dirs import made_once
from core_rl.roles.model_dir_checks import first_line
from core_rl.roles.remote_code import keep_custom_code

KEY = "data.chat_template"


def template_text(value: str, key: str) -> tuple[str | None, str | None]:
    """``(template, problem)``: ``value`` itself when it holds Jinja (a ``{``), else the text of the
    file it names; the problem names ``key`` when it is neither."""
    if "{" in value:
        return value, None
    path = Path(value)
    if not path.is_file():
        return None, f"{key}: {value!r} is neither a Jinja template nor a file (resolved: {path.resolve()})"
    try:
        return path.read_text(encoding="utf-8"), None
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{key}: cannot read {path} ({first_line(exc)})"


def apply_chat_template_override(cfg: RunConfig, *, root: Path | None = None) -> list[str]:
    """With ``data.chat_template``: make the tokenizer directory under ``root`` (default
    ``<run>/chat_template``) and point ``actor.tokenizer_path`` there (recorded as derived); return
    the problems (no directory is made with any)."""
    if not cfg.data.chat_template:
        return []
    template, problem = template_text(cfg.data.chat_template, KEY)
    if problem is not None:
        return [problem]
    assert template is not None
    root = root if root is not None else cfg.experiment.run_dir / "chat_template"
    target = root / "tokenizer"
    written = cfg.actor.tokenizer_path
    source = written or cfg.actor.model_path
    if not Path(source).is_dir() or Path(source).resolve() == target.resolve():
        return []  # a missing directory is preflight's to report; or applied already
    trust = cfg.actor.trust_remote_code
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=trust)
    except Exception:  # the tokenizer check reports it
        return []
    tokenizer.chat_template = template
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the user's template, however Jinja refuses it
        return [f"{KEY}: the template cannot render a user message ({first_line(exc)})"]
    stamp = json.dumps({"tokenizer": str(Path(source).resolve()), "chat_template": template}, sort_keys=True)

    def fill(partial: Path) -> None:
        tokenizer.save_pretrained(partial)
        keep_custom_code([source], partial)

    try:
        made = made_once(target, stamp, fill, rank=int(os.environ.get("RANK", "0")), what=KEY)
    except (OSError, TimeoutError) as exc:
        return [f"experiment.output_dir: cannot make {target} for {KEY} ({exc}); choose a writable output directory"]
    cfg.actor.tokenizer_path = str(made)
    record(cfg, Derived(("actor", "tokenizer_path"), str(made), written, f"{source} with {KEY}", at_start=True))
    return []
