"""Where a run stands, in steps: shared by a loop (:class:`~core_rl.loops.scaffold.RunScaffold`)
and the stages that read it (checkpointing writes it on a save and a resume)."""

from __future__ import annotations

import attrs


@attrs.define
class RunProgress:
    """``start_step``: the step the loop continues after (0, or a resumed checkpoint's);
    ``completed_step``: the last step trained; ``last_saved``: the newest checkpoint this run wrote
    or resumed from (``None``: none); ``resume_step``: the step a resumed run continues from
    (``None``: a fresh run, no resume asked for; loggers then keep nothing)."""

    start_step: int = 0
    completed_step: int = 0
    last_saved: int | None = None
    resume_step: int | None = None
