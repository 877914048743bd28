"""The sampling parameters of the vLLM engine's requests: what ``rollout.sampling`` becomes in
vLLM's names (with ``rollout.sampling.extra``), and greedy requests asked once for all ``n``."""

from __future__ import annotations

from typing import Any

import attrs
from core_rl.interfaces import SamplingParams
from core_rl.interfaces.sampling import required_json_schema, with_extra
from core_rl_server_kit.remote import Completion

from core_rl_vllm.config import VLLMConfig


def request_params(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM's sampling parameters for ``sampling`` (with its ``extra``)."""
    return with_extra(own_params(sampling), sampling, "vllm", VLLMConfig.request_keys)


def own_params(sampling: SamplingParams) -> dict[str, Any]:
    """The request keys the engine sets from ``sampling`` itself (:data:`VLLMConfig.request_keys` names them all)."""
    return {
        "n": sampling.n,
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": sampling.min_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0 if sampling.greedy else max(sampling.top_k, 0),
        "min_p": 0.0 if sampling.greedy else sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        # stop strings are matched in the text without special tokens, as core_rl.rollout.stop_strings does
        "skip_special_tokens": bool(sampling.stop),
        **({"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {}),
        # guided decoding: the schema the response_format requires (compact JSON: the server's settings)
        **(
            {"structured_outputs": {"json": required_json_schema(sampling.response_format)}}
            if sampling.response_format is not None
            else {}
        ),
    }


def as_sent(sampling: SamplingParams) -> tuple[SamplingParams, int]:
    """What vLLM is asked for ``sampling``, and how many times its one answer is repeated: vLLM
    refuses ``n > 1`` when greedy, and one greedy answer serves all ``n``."""
    if sampling.greedy and sampling.n > 1:
        return attrs.evolve(sampling, n=1), sampling.n
    return sampling, 1


def repeated(one: Completion, times: int) -> list[Completion]:
    return [attrs.evolve(one) for _ in range(times)]
