"""The configuration classes of the example plugin's components: the YAML section of each, validated
by the loader with its full key path in every message.

They live apart from the components so that registering the plugin (``plugin.py``) imports no torch:
``core-rl plugins`` and ``core-rl config validate`` stay fast, and torch is imported only when a run
builds the advantage estimator.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from core_rl.config.checks import SectionContext, group_size_problems
from core_rl.config.validators import FieldValueError, in_range, one_of, positive


@attrs.define
class RankAdvantageConfig:
    """The ``algorithm.advantage`` section of ``rank_advantage``.

    ``scale``: multiplies every advantage; a group with distinct rewards then spans
    ``[-scale/2, scale/2]`` (``scale: 2.0`` gives ``[-1, 1]``).
    ``allow_single_sample_groups``: accept ``rollout.sampling.n: 1`` (every advantage is then 0).
    """

    scale: float = attrs.field(default=1.0, validator=positive())
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        """Ranks compare the samples of a group: refuse groups of one unless allowed."""
        return group_size_problems(
            context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"
        )


MODES = ("fraction", "all")


def _no_empty_keywords(_inst: Any, attribute: attrs.Attribute[Any], value: list[str]) -> None:
    if any(not keyword.strip() for keyword in value):
        raise FieldValueError(attribute.name, value, "must not contain empty or blank keywords")


@attrs.define
class KeywordRewardConfig:
    """The ``reward`` section of ``keyword_reward``.

    - ``keywords``: keywords every response should mention.
    - ``row_key``: a data-row column holding more keywords for that row (a string or a list of
      strings); ``null`` to use ``keywords`` alone. At least one of the two must be set.
    - ``mode``: ``fraction`` (partial credit) or ``all`` (1 only when every keyword is found).
    - ``case_sensitive``: match case exactly.
    - ``whole_words``: a keyword must not be glued to a letter, digit or underscore.
    """

    keywords: list[str] = attrs.field(factory=list, validator=_no_empty_keywords)
    row_key: str | None = None
    mode: str = attrs.field(default="fraction", validator=one_of(MODES))
    case_sensitive: bool = False
    whole_words: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.keywords and self.row_key is None:
            raise FieldValueError("keywords", self.keywords, "must list at least one keyword when row_key is not set")

    def required_columns(self) -> list[str]:
        """The data-row column this reward reads (checked in every row before a run starts)."""
        return [self.row_key] if self.row_key is not None else []


@attrs.define
class PromptLMConfig:
    """The ``trainer.loop`` section of ``prompt_lm``: next-token training on the prompt text itself
    (continued pre-training on a column of plain text).

    ``rl_sections = False`` tells core-rl the loop needs no reward, advantage estimator or policy
    loss. ``max_tokens``: longer texts keep their first ``max_tokens`` tokens."""

    rl_sections: ClassVar[bool] = False

    max_tokens: int = attrs.field(default=512, validator=positive())


@attrs.define
class SecondTryConfig:
    """The ``rollout.workflow`` section of ``second_try``.

    - ``answer_key``: the data-row column holding the expected answer.
    - ``feedback``: the environment's reply after a wrong first answer, appended as tokens masked
      from the loss (every character must be in the tokenizer's vocabulary).
    - ``second_try_credit``: the reward of a second answer is this times its score.
    """

    answer_key: str = "answer"
    feedback: str = attrs.field(default="=", validator=attrs.validators.min_len(1))
    second_try_credit: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))

    def required_columns(self) -> list[str]:
        return [self.answer_key]
