"""Preflight: what ``core-rl train`` checks after the configuration is valid and before any model is
loaded, so that a bad file or a missing GPU fails in seconds with every problem listed at once
(:class:`~core_rl.errors.PreflightError`), not minutes into a run with a traceback.

- **Data** (:mod:`core_rl.data.prompts`): every entry of ``data.train_files`` (and ``eval.files``) is read and
  every row checked: valid UTF-8 JSON Lines / JSON / Parquet, saved or ``hf:`` datasets that load,
  the prompt column holds text, each column the reward declares (``required_columns()`` on its
  config class) is present and not null, each selected section's own ``check_data`` (e.g. the
  columns a training loop reads) passes, and each prompt tokenises to at most
  ``data.max_prompt_tokens`` ids inside the model's vocabulary (or is dropped, with
  ``data.filter_overlong_prompts``); with ``data.max_length``, the sequences the supervised loop
  builds of each row fit in it (:mod:`core_rl.loops.supervised.length_bound`: or are dropped, or cut, as
  ``data.truncation`` says). Problems name the file and its 1-based line
  (``train.jsonl:7``) or row (Parquet, datasets).
- **Model and tokenizer** (``actor.model_path``, ``actor.tokenizer_path``;
  :mod:`core_rl.roles.model_dir_checks`): local directories holding what transformers needs: a readable
  ``config.json`` of a known model type (or, with ``actor.trust_remote_code``, of one whose code the
  directory ships: :mod:`core_rl.roles.remote_code`), complete weights (safetensors headers are parsed and
  their sizes checked against the file, without loading a tensor) and a tokenizer that loads; for
  a vision-language model, Pillow installed (:func:`core_rl.vision.images.missing_pillow_problems`:
  one problem, not one for each image row).
  Nothing is downloaded unless ``experiment.offline`` is ``false``, which lets these paths name
  Hugging Face hub repositories (downloaded into the Hugging Face cache, then checked like local
  ones).
- **Model roles**: each role section's model directory like the actor's; a ``reward_model:`` must
  hold a score head and share the actor's tokenizer (:func:`core_rl.roles.build.reward_model_problems`).
- **Sampling against the model**: stop token ids inside the vocabulary; the longest prompt plus
  ``rollout.sampling.max_new_tokens`` inside the model's context.
- **LoRA against the model**: ``actor.lora.target_modules`` name modules the model has (the
  adapters applied to the model built on the ``meta`` device: no memory, no weights read).
- **Saved rollouts** (``rollout.replay_from``): a readable step file for each step, from the same
  tokenizer, inside the model's vocabulary (:func:`core_rl.rollout.replay.replay_problems`);
  a replay run skips the rollout engine's own machine checks.
- **Output**: the run directory ``experiment.output_dir/experiment.name`` can be created and
  written.
- **Machine**: each selected plugin's ``check_environment`` (:mod:`core_rl.config.checks`), e.g.
  a CUDA device or the NCCL backend on a machine without a GPU; ``rollout.sleep_while_training:
  true`` for a rollout engine that would generate on the CPU (:func:`core_rl.launch.placement.sleep_problems`);
  enough GPUs for the servers core-rl starts where the placement chooses theirs (:func:`server_gpu_problems`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import attrs

from core_rl.config.checks import (
    EnvironmentContext,
    MachineInfo,
    ModelInfo,
    SectionContext,
    data_problems,
    environment_problems,
    required_columns,
    visible_gpus,
)
from core_rl.config.problems import uses_rl_sections
from core_rl.config.schema import RunConfig
from core_rl.config.sections import selected_sections
from core_rl.data.prompts import (
    DataRow,
    TokenisedRows,
    announce_once,
    check_eval_data,
    check_rows,
    eval_data_config,
    mixture_sources,
    raw_chat_prompts_warning,
    read_data_files,
    tokenisation_key,
    tokenise_rows,
)
from core_rl.errors import CoreRLError, PreflightError
from core_rl.launch.placement import sleep_problems
from core_rl.loops.supervised.length_bound import run_bound
from core_rl.roles.build import reward_model_problems, role_sections, shared_tokenizer_problems
from core_rl.roles.model_dir_checks import check_model_dir, check_tokenizer_dir, first_line
from core_rl.roles.model_overrides import apply_model_overrides
from core_rl.rollout.chat_template_override import apply_chat_template_override
from core_rl.rollout.replay import replay_problems
from core_rl.vision.images import missing_pillow_problems


@attrs.define
class Preflight:
    """What the checks produced, for the trainer to use instead of reading it again: the data
    rows, the loaded tokenizer, what the model's config says, and the machine."""

    rows: list[DataRow]
    tokenizer: Any
    model: ModelInfo
    machine: MachineInfo


def detect_machine() -> MachineInfo:
    """The machine as torch sees it (CUDA devices, MPS) and the processes ``torchrun`` started
    on this node and in all (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``)."""
    import torch

    sizes = []
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        try:
            sizes.append(int(os.environ.get(name, "1")))
        except ValueError:
            sizes.append(1)
    local_world_size, world_size = sizes
    mps = getattr(torch.backends, "mps", None)
    return MachineInfo(
        cuda_device_count=visible_gpus(),
        mps_available=bool(mps is not None and mps.is_available()),
        local_world_size=local_world_size,
        world_size=world_size,
    )


def server_gpu_problems(cfg: RunConfig, machine: MachineInfo) -> list[str]:
    """Where the placement chooses the GPUs of the servers core-rl starts, whether there are enough
    (:func:`core_rl.launch.gpus.resolve_server_gpus`)."""
    from core_rl.launch.gpus import resolve_server_gpus

    try:
        resolve_server_gpus(cfg, machine)
    except CoreRLError as exc:
        return [str(exc)]
    return []


def _fetch(key: str, repo_id: str) -> tuple[str | None, str | None]:
    """Download a hub repository into the Hugging Face cache (``experiment.offline: false``)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id), None
    except Exception as exc:  # invalid ids, network and authorisation failures: all the user's to fix
        return None, f"{key}: cannot download {repo_id!r} from the Hugging Face hub: {first_line(exc)}"


def resolve_paths(cfg: RunConfig) -> list[str]:
    """With ``experiment.offline: false``, replace hub ids in ``actor.model_path`` and
    ``actor.tokenizer_path`` by their downloaded local directory; return the problems."""
    if cfg.experiment.offline:
        return []
    problems = []
    for key in ("model_path", "tokenizer_path"):
        value = getattr(cfg.actor, key)
        if value and not Path(value).exists():
            local, problem = _fetch(f"actor.{key}", value)
            if problem is not None:
                problems.append(problem)
            else:
                setattr(cfg.actor, key, local)
    return problems


def _required_columns(cfg: RunConfig) -> dict[str, str]:
    """Column -> who reads it, for the columns the reward declares."""
    if cfg.reward is None or cfg.reward.config is None:
        return {}
    return {column: f"reward {cfg.reward.name!r}" for column in required_columns(cfg.reward.config)}


def check_data(cfg: RunConfig) -> tuple[list[DataRow], list[str]]:
    """Read every data file and check its rows' columns (see the module docstring)."""
    rows, problems = read_data_files(cfg.data.train_paths, sources=cfg.data.sources)
    problems += check_rows(
        rows, cfg.data.prompt_key, _required_columns(cfg), chat_template=cfg.data.apply_chat_template
    )
    if not rows and not problems:
        problems.append("data.train_files: the files hold no rows")
    replay = cfg.rollout.replay_from is not None  # builds no rollout engine nor workflow
    for path, _kind, spec in selected_sections(cfg):
        if replay and path.startswith("rollout."):
            continue
        if spec.config is not None:
            problems += data_problems(spec.config, rows, SectionContext(path=path, run=cfg, name=spec.name))
    return rows, problems


def eval_data_problems(cfg: RunConfig, tokenizer: Any, model: ModelInfo | None) -> list[str]:
    """``eval.files`` read and checked as the training data is (the reward's columns and its own
    ``check_data``, ``eval.group_by``; with a ``tokenizer``, each prompt's tokens), and the longest eval prompt plus its
    ``max_new_tokens`` inside the model's context."""
    rows, problems = check_eval_data(cfg, _required_columns(cfg))
    if not problems and cfg.reward is not None and cfg.reward.config is not None:  # the reward scores them
        problems += data_problems(cfg.reward.config, rows, SectionContext(path="reward", run=cfg, name=cfg.reward.name))
    if problems or tokenizer is None:
        return problems
    vocab = model.vocab_size if model is not None else None
    items, problems = tokenise_rows(rows, eval_data_config(cfg), tokenizer, vocab_size=vocab, files_key="eval.files")
    context = model.context_length if model is not None else None
    assert cfg.eval is not None
    budget = cfg.eval.sampling.resolve(cfg.rollout.sampling).max_new_tokens
    longest = max((len(item.prompt_ids) for item in items), default=0)
    if context is not None and longest + budget > context:
        own = cfg.eval.sampling.max_new_tokens is not None
        key = "eval.sampling.max_new_tokens" + ("" if own else " (rollout.sampling.max_new_tokens, inherited)")
        problems.append(
            f"{key}: {budget} tokens after the longest prompt of eval.files ({longest} tokens) make "
            f"{longest + budget}, more than the model's context of {context} positions; "
            f"{'lower it' if own else 'set eval.sampling.max_new_tokens lower'} or use shorter prompts"
        )
    return problems


def check_sampling(cfg: RunConfig, model: ModelInfo, longest_prompt: int | None = None) -> list[str]:
    """Sampling settings that depend on the model: stop token ids inside the vocabulary, and, where
    the loop samples (it uses the RL sections; sft, dpo and rm generate nothing), the longest prompt
    (``longest_prompt`` tokens, when the data was read) plus ``rollout.sampling.max_new_tokens``
    inside the model's context (:attr:`ModelInfo.context_length`: an inference server refuses longer
    requests, and past it are positions the model never learnt). A multi-turn trajectory's first
    turn is already this long."""
    sampling = cfg.rollout.sampling
    problems = []
    if model.vocab_size is not None:
        problems += [
            f"rollout.sampling.stop_token_ids[{i}]: {token} is outside the model's vocabulary (vocab_size "
            f"{model.vocab_size} in {model.path}/config.json)"
            for i, token in enumerate(sampling.stop_token_ids)
            if token >= model.vocab_size
        ]
    context = model.context_length
    if context is None or longest_prompt is None or not uses_rl_sections(cfg):
        return problems
    if longest_prompt + sampling.max_new_tokens > context:
        room = context - longest_prompt
        problems.append(
            f"rollout.sampling.max_new_tokens: {sampling.max_new_tokens} tokens after the longest prompt of "
            f"data.train_files ({longest_prompt} tokens) make {longest_prompt + sampling.max_new_tokens}, more than "
            f"the model's context of {context} positions (max_position_embeddings in {model.path}/config.json); "
            + (f"set it to at most {room}" if room > 0 else "the prompts alone fill it")
            + ", or use shorter prompts"
        )
    return problems


def check_output_dir(cfg: RunConfig, *, create: bool = True) -> list[str]:
    """The run directory can be created and written (it is created here; with ``create=False``
    nothing is created and its nearest existing ancestor must be a writable directory)."""
    run_dir = cfg.experiment.run_dir
    if not create:
        return _creatable_problems(run_dir)
    what = "create the run directory"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        what = "write in the run directory"
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return [
            f"experiment.output_dir: cannot {what} {str(run_dir)!r}: {reason}; choose a writable "
            "experiment.output_dir (or another experiment.name)"
        ]
    return []


def _creatable_problems(run_dir: Path) -> list[str]:
    """Whether ``run_dir`` exists as a writable directory, or could be created (its nearest
    existing ancestor is a writable directory), without creating anything."""
    existing = run_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return []
    reason = "not a directory" if not existing.is_dir() else "permission denied"
    return [
        f"experiment.output_dir: cannot create or write the run directory {str(run_dir)!r} "
        f"({str(existing)!r}: {reason}); choose a writable experiment.output_dir (or another experiment.name)"
    ]


def plugin_environment_problems(cfg: RunConfig, machine: MachineInfo, model: ModelInfo | None) -> list[str]:
    """Every selected plugin section's own ``check_environment``."""
    problems: list[str] = []
    replay = cfg.rollout.replay_from is not None  # builds no rollout engine nor workflow
    for path, _kind, spec in selected_sections(cfg):
        if replay and path.startswith("rollout."):
            continue
        if spec.config is not None:
            context = EnvironmentContext(path=path, run=cfg, name=spec.name, machine=machine, model=model)
            problems.extend(environment_problems(spec.config, context))
    return problems


def _scratch_dir() -> Path:
    """A directory removed at exit (``config validate --preflight`` makes no run directory)."""
    import atexit
    import shutil

    path = Path(tempfile.mkdtemp(prefix="core-rl-preflight-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _freeze_problems(cfg: RunConfig) -> list[str]:
    """``actor.freeze`` and ``critic.freeze`` against their models' parameter names, the models
    built on the ``meta`` device (:mod:`core_rl.roles.freezing`); a model that cannot be built so is
    left to its engine."""
    from core_rl.roles.freezing import freeze_problems
    from core_rl.roles.hf import empty_causal_lm, empty_value_model

    problems: list[str] = []
    trained = [("actor", cfg.actor, empty_causal_lm), ("critic", cfg.critic, empty_value_model)]
    for role, section, empty in trained:
        if section is None or not section.freeze or not Path(section.model_path).is_dir():
            continue
        try:
            model = empty(section.model_path, dtype="float32", trust_remote_code=section.trust_remote_code)
        except Exception:  # e.g. a model class that computes in __init__
            continue
        problems += freeze_problems(model, section.freeze, f"{role}.freeze")
    return problems


def preflight(cfg: RunConfig, *, machine: MachineInfo | None = None, create_output_dir: bool = True) -> Preflight:
    """Run every check of the module docstring on a validated ``cfg`` (as :func:`load_config`
    returns it); raise :class:`~core_rl.errors.PreflightError` listing all problems found, else
    return what the checks read. ``machine``: the machine to check against (default: this one).
    ``create_output_dir=False`` (``core-rl config validate --preflight``) creates no run directory."""
    offline = cfg.experiment.offline
    problems = resolve_paths(cfg)
    problems += apply_model_overrides(cfg, root=None if create_output_dir else _scratch_dir())
    problems += apply_chat_template_override(cfg, root=None if create_output_dir else _scratch_dir())
    rows, row_problems = check_data(cfg)
    problems += row_problems
    trust = cfg.actor.trust_remote_code
    model, model_problems = check_model_dir(
        cfg.actor.model_path, "actor.model_path", offline=offline, trust_remote_code=trust
    )
    problems += model_problems
    # without Pillow every image row would fail alike: one problem instead of one a row
    no_pillow = missing_pillow_problems(cfg.actor.model_path, "actor.model_path")
    problems += no_pillow
    tokenizer, longest_prompt = None, None
    if cfg.actor.tokenizer_path or Path(cfg.actor.model_path).is_dir():
        key = "actor.tokenizer_path" if cfg.actor.tokenizer_path else "actor.model_path"
        tokenizer, tokenizer_problems = check_tokenizer_dir(
            cfg.actor.tokenizer_path or cfg.actor.model_path, key, offline=offline, trust_remote_code=trust
        )
        problems += [p for p in tokenizer_problems if p not in model_problems]  # one refusal of shipped code
    if tokenizer is not None and not no_pillow:
        if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            problems.append(
                "data.apply_chat_template: the tokenizer has no chat template; set data.apply_chat_template=false "
                "or use a tokenizer that has one"
            )
        elif not row_problems:
            items, prompt_problems = tokenise_rows(
                rows, cfg.data, tokenizer, vocab_size=model.vocab_size if model is not None else None
            )
            select = run_bound(cfg, tokenizer)  # data.max_length: the loop's sequences of each row
            if not prompt_problems and select is not None:
                items, prompt_problems = select(items)
            problems += prompt_problems
            if not prompt_problems and cfg.data.train_weights is not None:  # a mixture's sources, each non-empty
                problems += mixture_sources(items, cfg.data)[1]
            longest_prompt = max((len(item.prompt_ids) for item in items), default=None)
            if not prompt_problems and (raw := raw_chat_prompts_warning(rows, cfg.data, tokenizer)):
                announce_once(raw)
            key = tokenisation_key(cfg.data, tokenizer)
            if not prompt_problems and key is not None:  # the trainer takes these items as they are
                rows = TokenisedRows(rows, items, key)
    if cfg.eval is not None and not no_pillow:
        chat_ok = not cfg.data.apply_chat_template or getattr(tokenizer, "chat_template", None)
        problems += eval_data_problems(cfg, tokenizer if chat_ok else None, model)
    if model is not None:
        problems += check_sampling(cfg, model, longest_prompt)
        if cfg.actor.lora.enabled:
            from core_rl.roles.hf import lora_problems

            problems += lora_problems(cfg.actor.model_path, cfg.actor.lora, "actor.lora", trust_remote_code=trust)
        problems += _freeze_problems(cfg)
    for role, section in role_sections(cfg):  # the other model roles
        if not section.model_path:
            continue
        dir_problems = check_model_dir(
            section.model_path, f"{role}.model_path", offline=offline, trust_remote_code=section.trust_remote_code
        )[1]
        problems += dir_problems
        if dir_problems or not Path(section.model_path).is_dir():
            continue
        # no score head, or a tokenizer other than the policy's (whose token ids the role reads)
        if role == "reward_model":
            problems += reward_model_problems(cfg, tokenizer)
        else:
            problems += shared_tokenizer_problems(cfg, role, section, tokenizer)
    if cfg.rollout.replay_from is not None:  # saved rollouts: rollout/replay.py
        problems += replay_problems(cfg, tokenizer, model.vocab_size if model is not None else None)
    problems += check_output_dir(cfg, create=create_output_dir)
    machine = machine if machine is not None else detect_machine()
    problems += plugin_environment_problems(cfg, machine, model)
    if cfg.rollout.replay_from is None:  # a replay run builds no rollout engine
        # rollout.sleep_while_training: true on a machine without CUDA (the rest was checked at load)
        problems += sleep_problems(cfg, cuda_available=machine.cuda_available)
        problems += server_gpu_problems(cfg, machine)
    if problems:
        raise PreflightError(problems)
    assert model is not None
    return Preflight(rows=rows, tokenizer=tokenizer, model=model, machine=machine)
