"""Counting each plugin's calls, timeouts and errors that a run survives, so they are said.

A call that timed out or failed and that the run goes past (an environment step past
``rollout.workflow.tool_timeout_s``, a reward call past ``reward_runner.timeout_s``) is recorded
here by the code that made it (:meth:`PluginTally.record`, thread-safe: the rollout controller's
loop and the reward's workers record from their own threads). Once per step the trainer takes what
was recorded since the last step (:meth:`PluginTally.take`): for each plugin, the metrics
``plugins/<metric>/calls``, ``plugins/<metric>/timeouts`` and ``plugins/<metric>/errors``, and a
one-line warning naming the plugin when its failed calls pass a fraction of its calls in the step
(:func:`warnings_for`). There is one tally per process, :data:`PLUGIN_TALLY`. Light: no torch.
"""

from __future__ import annotations

import threading

import attrs


@attrs.define
class Counts:
    """One plugin's counts in a step: ``words`` name it in messages (kind, name, distribution);
    ``what`` says what a timeout is for it (``step past rollout.workflow.tool_timeout_s=5 s``);
    ``said``: its failures are warned about where they happen (the reward's error log), so
    :func:`warnings_for` does not repeat them."""

    words: str
    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    what: str = ""
    said: bool = False

    @property
    def failed(self) -> int:
        """Calls that timed out or raised."""
        return self.timeouts + self.errors


class PluginTally:
    """See the module docstring. Plugins are keyed by ``metric``, the part of their metric keys
    after ``plugins/`` (``environment.calculator``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, Counts] = {}

    def record(
        self,
        metric: str,
        words: str,
        *,
        calls: int = 1,
        timeouts: int = 0,
        errors: int = 0,
        what: str = "",
        said: bool = False,
    ) -> None:
        """Count ``calls`` calls of the plugin ``metric`` (named ``words``), of which ``timeouts``
        timed out and ``errors`` raised; ``what``: what a timeout means for it (kept from the last
        record that gives one); ``said``: see :class:`Counts`."""
        with self._lock:
            counts = self._counts.setdefault(metric, Counts(words, said=said))
            counts.calls += calls
            counts.timeouts += timeouts
            counts.errors += errors
            if what:
                counts.what = what

    def take(self) -> dict[str, Counts]:
        """What was recorded since the last :meth:`take` (or the start), by metric name; clears it."""
        with self._lock:
            taken, self._counts = self._counts, {}
        return taken


def tally_metrics(taken: dict[str, Counts]) -> dict[str, float]:
    """``plugins/<metric>/calls``, ``/timeouts`` and ``/errors`` of each plugin in ``taken``."""
    out: dict[str, float] = {}
    for metric, c in taken.items():
        out[f"plugins/{metric}/calls"] = float(c.calls)
        out[f"plugins/{metric}/timeouts"] = float(c.timeouts)
        out[f"plugins/{metric}/errors"] = float(c.errors)
    return out


def warnings_for(taken: dict[str, Counts], step: int, fraction: float, key: str) -> list[str]:
    """One line per plugin whose timed-out and failed calls in step ``step`` are more than
    ``fraction`` of its calls, but those whose failures are said elsewhere (:attr:`Counts.said`);
    ``key``: the config key of ``fraction``, named in the line."""
    lines = []
    for c in taken.values():
        if c.calls and not c.said and c.failed / c.calls > fraction:
            parts = [f"{c.timeouts} timed out" + (f" ({c.what})" if c.what else "")] if c.timeouts else []
            parts += [f"{c.errors} raised"] if c.errors else []
            lines.append(
                f"core-rl: warning: step {step}: {c.words}: {c.failed} of {c.calls} calls failed "
                f"({', '.join(parts)}), more than {key}={fraction:g} of them"
            )
    return lines


#: this process's tally
PLUGIN_TALLY = PluginTally()
