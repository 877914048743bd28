"""The ``rollout.sampling`` section: how the rollout engine samples (the ``eval.sampling`` section
replaces some of its keys, :mod:`core_rl.config.eval_config`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.validators import MAX_COUNT, MAX_TOKENS, FieldValueError, each, in_range, not_empty

if TYPE_CHECKING:
    from core_rl.interfaces import SamplingParams


@attrs.define
class SamplingConfig:
    """Rollout sampling. ``n`` is the group size (samples per prompt). ``min_new_tokens`` must not
    exceed ``max_new_tokens``; stop token ids are checked against the model's vocabulary before
    the run starts. ``stop``: strings that end a response at the token completing one (it stays in
    the trajectory; :mod:`core_rl.rollout.stop_strings`). ``min_p`` in [0, 1): keep the tokens whose
    probability is at least ``min_p`` times the most likely token's (0: off; ignored when greedy,
    like ``top_p``).

    Penalties (vLLM's definitions, the OpenAI API's for the last two), applied to the logits ``z``
    of the next token before temperature and the filters, greedy included, in this order:
    ``repetition_penalty`` (in (0, 2], default 1: off) divides a positive ``z_j`` by it and
    multiplies a negative one for every token ``j`` already in the prompt or the response;
    ``frequency_penalty`` (in [-2, 2], default 0: off) subtracts ``frequency_penalty * c_j``,
    ``c_j`` the times ``j`` is in the response so far (not the prompt); ``presence_penalty`` (in
    [-2, 2], default 0: off) subtracts ``presence_penalty`` once if ``c_j > 0``. Positive values
    discourage repeats. The ranges are the strictest engine's (SGLang: repetition at most 2).
    Like the filters they only change what is sampled (:class:`core_rl.interfaces.SamplingParams`
    says which log-probs each engine reports).

    ``extra``: sampling parameters a server engine passes to its server as they are (vLLM's or
    SGLang's names, e.g. ``{ignore_eos: true}``, ``{logit_bias: {...}}``), for what core-rl does
    not name itself; a key core-rl sets from this section is refused, and the ``hf`` engine, which
    samples in process, refuses any. What they change is sampled, not what the behaviour log-probs
    mean (consider ``algorithm.recompute_logprob``)."""

    n: int = attrs.field(default=8, validator=in_range(1, MAX_COUNT))
    temperature: float = attrs.field(default=1.0, validator=in_range(0.0, 100.0, low_open=True))
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=0, validator=in_range(0, MAX_TOKENS))
    min_p: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0, high_open=True))
    repetition_penalty: float = attrs.field(default=1.0, validator=in_range(0.0, 2.0, low_open=True))
    frequency_penalty: float = attrs.field(default=0.0, validator=in_range(-2.0, 2.0))
    presence_penalty: float = attrs.field(default=0.0, validator=in_range(-2.0, 2.0))
    max_new_tokens: int = attrs.field(default=256, validator=in_range(1, MAX_TOKENS))
    min_new_tokens: int = attrs.field(default=0, validator=in_range(0, MAX_TOKENS))
    stop_token_ids: list[int] = attrs.field(factory=list, validator=each(in_range(0, MAX_TOKENS)))
    stop: list[str] = attrs.field(factory=list, validator=each(not_empty()))
    greedy: bool = False
    extra: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        named = sorted(set(self.extra) & {f.name for f in attrs.fields(SamplingConfig)})
        if named:
            raise FieldValueError("extra", named, f"{', '.join(named)}: set by this section's own keys; use them")
        if self.min_new_tokens > self.max_new_tokens:
            raise FieldValueError(
                "min_new_tokens", self.min_new_tokens, f"must be <= max_new_tokens ({self.max_new_tokens})"
            )

    def to_params(self) -> SamplingParams:
        from core_rl.interfaces import SamplingParams

        return SamplingParams(**attrs.asdict(self))
