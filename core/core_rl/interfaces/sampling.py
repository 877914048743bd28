"""What a rollout engine is asked to sample (:class:`SamplingParams`), built from the
``rollout.sampling`` and ``eval.sampling`` sections; re-exported by :mod:`core_rl.interfaces`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from core_rl.errors import CoreRLError


@attrs.define
class SamplingParams:
    """How to sample: ``n`` responses per prompt; ``greedy`` overrides temperature/top-k/top-p/min-p.

    ``top_k <= 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters. min-p keeps the tokens
    whose probability (after temperature) is at least ``min_p`` times the most likely token's.
    Like top-k/top-p it only filters what is sampled: the behaviour log-probs stay those of
    ``log_softmax(logits / temperature)`` wherever the engine reports them so.

    ``repetition_penalty`` (1: off), ``frequency_penalty`` and ``presence_penalty`` (0: off)
    change the next-token logits ``z`` before temperature and the filters, greedy choice included
    (:class:`core_rl.config.sampling.SamplingConfig` has the formulas). Where engines differ:
    hf and vLLM apply repetition, then frequency, then presence, the repetition penalty to the
    prompt's tokens and the response's; SGLang applies frequency and presence, then repetition,
    to the response's tokens only. Behaviour log-probs: hf keeps ``log_softmax(logits / T)``
    of the unpenalised logits (a penalty is a sampling device like the filters, and the
    trainer's recomputed log-probs are those); vLLM and SGLang report those of the penalised
    logits. Generation stops at EOS, at any of
    ``stop_token_ids``, or after ``max_new_tokens``; the first ``min_new_tokens`` tokens are
    never a stop (so a response that stops early has at least ``min_new_tokens + 1`` tokens).
    ``stop`` strings end a response at the token that completes one; the rollout controller cuts
    every engine's responses there (:mod:`core_rl.rollout.stop_strings`), so an engine may ignore them
    or stop later. An engine whose config class sets ``stop_strings = True`` stops there itself,
    saving the tokens after (``hf``, ``vllm``; ``sglang`` when ``min_new_tokens`` is 0); it must
    never stop before the cut, which the rollout contract checks. ``extra``: server parameters
    passed as they are (:func:`with_extra`; ``rollout.sampling.extra``).

    ``response_format`` (guided decoding; ``None``: free text): ``{"type": "json_object"}`` (any JSON
    object) or ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}`` (a JSON value the
    schema accepts), in the OpenAI chat form. Only an engine whose :attr:`RolloutEngine.guided_decoding
    <core_rl.interfaces.RolloutEngine.guided_decoding>` is true is asked for it (the rollout controller
    refuses it for any other with :class:`GuidedDecodingUnsupported`); it enforces
    :func:`required_json_schema`. The behaviour log-probs stay the engine's (of the constrained
    distribution where the engine reports processed log-probs), so the train/rollout mismatch metrics
    show what the constraint changed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_token_ids: list[int] = attrs.field(factory=list)
    greedy: bool = False
    stop: list[str] = attrs.field(factory=list)
    extra: dict[str, Any] = attrs.field(factory=dict)
    response_format: dict[str, Any] | None = None


class GuidedDecodingUnsupported(CoreRLError):
    """A request asked for ``response_format`` (:attr:`SamplingParams.response_format`) of a rollout
    engine that has no guided decoding; the message names the engine."""


def required_json_schema(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema an engine enforces for ``response_format`` (:attr:`SamplingParams.response_format`):
    ``{"type": "object"}`` for ``json_object``, the given ``json_schema.schema`` for ``json_schema``.
    Anything else is a :class:`ValueError` saying what is accepted."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if kind == "json_schema" and isinstance(spec, Mapping) and isinstance(spec.get("schema"), Mapping):
        return dict(spec["schema"])
    raise ValueError(
        f"response_format {dict(response_format)!r:.200}: expected {{'type': 'json_object'}} or "
        "{'type': 'json_schema', 'json_schema': {'schema': {...}}}"
    )


def batch_key(sampling: SamplingParams) -> tuple:
    """A hashable key of every field of ``sampling``: requests whose keys are equal may share one
    engine call (lists as tuples, dicts such as ``extra`` as their items sorted by the keys' text,
    so two requests that differ only in a server parameter are batched apart, and a dict's key
    order or mixed key types do not matter)."""
    return tuple(_frozen(value) for value in attrs.astuple(sampling, recurse=False))


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), _frozen(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def with_extra(
    params: dict[str, Any], sampling: SamplingParams, engine: str, reserved: Collection[str] = ()
) -> dict[str, Any]:
    """``params`` (the request's sampling parameters an engine builds) with ``sampling.extra``
    added; a key of ``extra`` the engine sets itself (in ``params``, or among ``reserved``: the
    ``request_keys`` of its config class, which ``config validate`` refuses already) is a
    :class:`ValueError` naming it."""
    taken = sorted(set(sampling.extra) & (set(params) | set(reserved)))
    if taken:
        raise ValueError(
            f"rollout.sampling.extra: the {engine} engine sets {', '.join(taken)} itself (from rollout.sampling); "
            "remove them from extra"
        )
    return {**params, **sampling.extra}
