"""The ``reward`` section of ``code`` (no heavy imports)."""

from __future__ import annotations

import attrs
from core_rl.config.validators import in_range, one_of

from core_rl_reward_code.sandbox import SandboxLimits


@attrs.define
class CodeConfig:
    """See the package README.

    ``tests_key``: the row column with the tests: Python source, a list of Python snippets
    (asserts) or a list of ``{input, output}`` stdin/stdout cases. ``mode``: ``auto`` picks
    ``stdio`` for a list of mappings and ``assert`` otherwise. ``extract``: ``last_block`` takes the
    last fenced code block of the response (the whole response if it has none), ``raw`` the whole
    response. ``partial_credit``: score the fraction of tests passed instead of all-or-nothing.
    ``num_workers``: sandboxed runs at once."""

    tests_key: str = "tests"
    mode: str = attrs.field(default="auto", validator=one_of(("auto", "assert", "stdio")))
    extract: str = attrs.field(default="last_block", validator=one_of(("last_block", "raw")))
    partial_credit: bool = False
    num_workers: int = attrs.field(default=2, validator=in_range(1, 64))
    sandbox: SandboxLimits = attrs.field(factory=SandboxLimits)

    def required_columns(self) -> list[str]:
        """Every data row must hold its tests (checked before the run starts)."""
        return [self.tests_key]
