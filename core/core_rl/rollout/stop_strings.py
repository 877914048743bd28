"""Stop strings (``rollout.sampling.stop``, an OpenAI request's ``stop``): a response ends with the
first token whose text completes one of them.

The cut is made on token ids, so the trajectory holds exactly what the model sampled up to there:
response ``y`` is cut to ``y[:k]`` with ``k`` the fewest tokens whose text (``decode(y[:k])``, the
response decoded on its own without special tokens, whose names such as ``<pad>`` are not text the
model wrote) holds a stop string that ends after the text of the first ``min_new_tokens`` tokens:
a token after the first ``min_new_tokens`` completes it, so ``k > min_new_tokens``. That is the rule
of ``min_new_tokens`` for the end-of-sequence and stop tokens too (masked for the first
``min_new_tokens`` tokens in HF, vLLM and SGLang), and vLLM's rule for stop strings, so vLLM stops
where this cut does. Cutting what an engine generated
past that point samples the same distribution as stopping there: the tokens after it are dropped
whole. ``finish_reason`` becomes ``"stop"``; the last token may carry text past the stop string's end
(a token that spans it), which stays in the trajectory.

Finding ``k``: one decode of the whole response when it holds no stop string (the usual case), else
a binary search over prefixes (the stop string stays in every longer prefix's text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from core_rl.protocol import Sample

Decode = Callable[[Sequence[int]], str]


def stop_cut(ids: Sequence[int], decode: Decode, stops: Sequence[str], *, min_tokens: int = 0) -> int | None:
    """The number of tokens to keep (module docstring), or ``None`` when no token after the first
    ``min_tokens`` completes a stop string."""
    if not stops or len(ids) <= min_tokens:
        return None
    base = len(decode(ids[:min_tokens])) if min_tokens else 0  # only occurrences ending after this count

    def found(k: int) -> bool:
        text = decode(ids[:k])
        return any(text.find(stop, max(0, base - len(stop) + 1)) >= 0 for stop in stops)

    if not found(len(ids)):
        return None
    low, high = min_tokens + 1, len(ids)  # found(high); find the fewest tokens that still find it
    while low < high:
        middle = (low + high) // 2
        if found(middle):
            high = middle
        else:
            low = middle + 1
    return high


def text_before_stop(text: str, stops: Sequence[str], *, after: int = 0) -> tuple[str, str | None]:
    """``text`` up to (without) the first occurrence of any of ``stops`` that ends after character
    ``after`` (the text of the first ``min_new_tokens`` tokens, where none may stop), and
    that stop string (``None`` when none occurs): what an OpenAI-compatible answer returns."""
    found = [(i, stop) for stop in stops if stop and (i := text.find(stop, max(0, after - len(stop) + 1))) >= 0]
    if not found:
        return text, None
    start, stop = min(found)
    return text[:start], stop


def stop_change(
    ids: Sequence[int], finish_reason: str, decode: Decode, stops: Sequence[str], *, min_tokens: int = 0
) -> int | None:
    """The tokens to keep of a finished response that a stop string ends (:func:`stop_cut`), or
    ``None`` when the response stays as it is (no stop string, or it already stops on its last
    token)."""
    keep = stop_cut(ids, decode, stops, min_tokens=min_tokens)
    if keep is None or (keep == len(ids) and finish_reason == "stop"):
        return None
    return keep


def cut_sample(sample: Sample, keep: int) -> Sample:
    """``sample`` with its first ``keep`` response tokens (and their log-probs, versions, mask and
    routes), finished with ``"stop"``; the new last token's route becomes -1 (it is no longer fed)."""

    def head(values: list | None) -> list | None:
        return None if values is None else list(values[:keep])

    return attrs.evolve(
        sample,
        response_ids=list(sample.response_ids[:keep]),
        logprobs=list(sample.logprobs[:keep]),
        token_weight_versions=head(sample.token_weight_versions),
        token_mask=head(sample.token_mask),
        finish_reason="stop",
        routed_experts=_cut_routes(sample, keep),
    )


def _cut_routes(sample: Sample, keep: int) -> Any:
    """The routes of ``sample``'s prompt and first ``keep`` response tokens (``None`` without
    routes), the last of those without a route (-1): the model never ran over it."""
    routes = getattr(sample, "routed_experts", None)
    if routes is None:
        return None
    routes = routes[: len(sample.prompt_ids) + keep].clone()
    if keep > 0:
        routes[-1] = -1
    return routes


def apply_stop_strings(
    samples: Sequence[Sample], decode: Decode, stops: Sequence[str], min_tokens: int
) -> list[Sample]:
    """Each of ``samples`` cut at its first stop string (:func:`stop_cut`), the others as they are."""
    out = []
    for sample in samples:
        keep = stop_change(sample.response_ids, sample.finish_reason, decode, stops, min_tokens=min_tokens)
        out.append(sample if keep is None else cut_sample(sample, keep))
    return out
