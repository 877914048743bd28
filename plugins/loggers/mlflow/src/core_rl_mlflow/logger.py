"""The ``mlflow`` logger: each step's metrics as MLflow metrics at that step, the run's
configuration as params (dotted keys), logged samples as a JSON table artifact per step
(``samples/step_<step>.json``), through ``mlflow.MlflowClient`` (no fluent "active run", no
autologging, no system metrics).

The tracking store: ``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's default
(``sqlite:///mlflow.db`` in the working directory). The MLflow run's id is kept in
``<run dir>/mlflow_run.json``: a resumed run (:attr:`RunInfo.resume_step` set) continues that MLflow
run when the store still holds it. ``close()`` ends the MLflow run ``FINISHED``, or, when it is
called while an exception propagates (the trainer closes its loggers in a ``finally``), ``KILLED``
for an interruption (SIGINT/SIGTERM: :class:`~core_rl.loops.errors.TrainingInterrupted`, or a
``BaseException`` that is not an ``Exception``, such as ``KeyboardInterrupt``) and ``FAILED`` for any
other error.

Names MLflow rejects are mapped deterministically by :func:`mlflow_name` (see the README).
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from core_rl.checkpoint import write_text_atomic
from core_rl.errors import CoreRLError, stderr_line
from core_rl.interfaces import Logger, RunInfo, SampleRecord, sample_table
from core_rl.loops import TrainingInterrupted
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from core_rl_mlflow.plugin import MAX_NAME_LENGTH, NAME_CHARS, MlflowConfig, is_mlflow_name

#: the file in the run directory that names the MLflow run (for a resumed run to continue it)
RUN_FILE = "mlflow_run.json"
#: the MLflow experiment when neither ``experiment_name`` nor ``MLFLOW_EXPERIMENT_NAME`` names one
DEFAULT_EXPERIMENT = "core-rl"
#: what ends a param value cut to MLflow's limit
TRUNCATED = "...[truncated]"
_BAD_CHARS = re.compile(f"[^{NAME_CHARS}]")
_SEGMENTS = {"": "_", ".": "_", "..": "__"}


def note(text: str) -> None:
    stderr_line(f"core-rl: note: logger 'mlflow': {text}")


def mlflow_name(name: str) -> str:
    """``name`` as an MLflow metric / param name: unchanged where MLflow accepts it; otherwise
    ``@`` -> ``_at_``, every other character MLflow rejects -> ``_``, a path segment that is empty,
    ``.`` or ``..`` -> ``_``, ``_``, ``__``, a leading ``..`` -> ``_.``, cut to 250 characters."""
    if is_mlflow_name(name):
        return name
    text = _segments(_BAD_CHARS.sub("_", name.replace("@", "_at_")))
    if len(text) > MAX_NAME_LENGTH:  # cut; mending a last segment cut to "" or "." adds one character at most
        text = _segments(text[: MAX_NAME_LENGTH - 1])
    return text


def _segments(text: str) -> str:
    text = "/".join(_SEGMENTS.get(part, part) for part in text.split("/"))
    return "_" + text[1:] if text.startswith("..") else text


def _param_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1, "c": [1, 2]}}`` -> ``{"a.b": "1", "a.c": "[1, 2]"}``: nested mappings by dotted
    keys, a list (or an empty mapping) as its JSON text, anything else as ``str``."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = _param_value(value)
    return out


def _json_cell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf (as in samples.jsonl)
    return value


class MlflowLogger(Logger):
    def __init__(self, config: MlflowConfig) -> None:
        self.config = config
        self.client: MlflowClient | None = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self._names: dict[str, str] = {}  # metric name -> its MLflow name
        self._reported: set[tuple[str, str]] = set()

    # -- start --------------------------------------------------------------------------------

    def start(self, run: RunInfo) -> None:
        import mlflow

        cfg = self.config
        uri = cfg.tracking_uri or mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, else MLflow's default
        self.tracking_uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            run_id = self._continued_run(run) if run.resume_step is not None else None
            if run_id is None:
                run_id = self._new_run(run)
            else:
                self.client.update_run(run_id, status="RUNNING")
                self.client.set_tag(run_id, "core_rl.resume_step", str(run.resume_step))
                for key, value in cfg.tags.items():
                    self.client.set_tag(run_id, key, value)
            self.run_id = run_id
            run.output_dir.mkdir(parents=True, exist_ok=True)
            record = {"tracking_uri": uri, "run_id": run_id}
            write_text_atomic(run.output_dir / RUN_FILE, json.dumps(record, indent=2) + "\n")
            if cfg.log_config:
                self._log_params(run.config)
        except Exception as exc:
            if self.run_id is not None:  # the trainer will not close a logger that failed to start
                self._end("FAILED")
            if isinstance(exc, CoreRLError):
                raise
            raise CoreRLError(f"logger 'mlflow' could not start with tracking URI {uri}: {exc}") from exc

    def _experiment_id(self) -> str:
        assert self.client is not None
        name = self.config.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(name, artifact_location=self.config.artifact_location)
            except MlflowException as exc:  # created meanwhile by another process
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise exc from None
        if experiment.lifecycle_stage != "active":
            raise CoreRLError(
                f"logger 'mlflow': the MLflow experiment {name!r} in {self.tracking_uri} is deleted; "
                f"restore it (mlflow experiments restore --experiment-id {experiment.experiment_id}) "
                "or choose another experiment_name"
            )
        return experiment.experiment_id

    def _new_run(self, run: RunInfo) -> str:
        assert self.client is not None
        tags = {"core_rl.run_dir": str(run.output_dir), **self.config.tags}
        created = self.client.create_run(self._experiment_id(), tags=tags, run_name=self.config.run_name or run.name)
        return created.info.run_id

    def _continued_run(self, run: RunInfo) -> str | None:
        """The MLflow run ``<run dir>/mlflow_run.json`` names, if this store holds it (active)."""
        assert self.client is not None
        try:
            record = json.loads((run.output_dir / RUN_FILE).read_text())
            run_id, uri = str(record["run_id"]), str(record["tracking_uri"])
        except (OSError, ValueError, KeyError, TypeError):
            note(f"no MLflow run recorded in {run.output_dir / RUN_FILE}: the resumed run starts a new MLflow run")
            return None
        if uri != self.tracking_uri:
            note(f"the run's MLflow run {run_id} is in {uri}, not in {self.tracking_uri}: starting a new MLflow run")
            return None
        try:
            found = self.client.get_run(run_id)
        except MlflowException:
            found = None
        if found is None or found.info.lifecycle_stage != "active":
            note(f"MLflow run {run_id} is not in {uri} (or is deleted): starting a new MLflow run")
            return None
        return run_id

    def _log_params(self, config: Mapping[str, Any]) -> None:
        """The config as params. MLflow params cannot change: on a continued run only the keys it
        lacks are added, and values that differ from the recorded ones are named in a note."""
        assert self.client is not None and self.run_id is not None
        params: dict[str, str] = {}
        truncated: list[str] = []
        for key, value in flatten_config(config).items():
            name = mlflow_name(key)
            if name in params:
                note(f"config keys {key!r} and another both map to the MLflow param {name!r}: the first is kept")
                continue
            if len(value) > MAX_PARAM_VAL_LENGTH:
                value = value[: MAX_PARAM_VAL_LENGTH - len(TRUNCATED)] + TRUNCATED
                truncated.append(name)
            params[name] = value
        if truncated:
            note(
                f"{len(truncated)} config value(s) longer than MLflow's {MAX_PARAM_VAL_LENGTH} characters were "
                f"cut, ending in {TRUNCATED!r}: {', '.join(truncated)}"
            )
        recorded = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in recorded and recorded[k] != v)
        if changed:
            note(f"MLflow params keep their first values; these changed on resume: {', '.join(changed)}")
        new = [Param(k, v) for k, v in params.items() if k not in recorded]
        self.client.log_batch(self.run_id, params=new)

    # -- logging ------------------------------------------------------------------------------

    def _metric_name(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = mlflow_name(key)
        return name

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.client is None or self.run_id is None:
            return
        timestamp = int(time.time() * 1000)
        batch: dict[str, Metric] = {}
        for key, value in metrics.items():
            name = self._metric_name(key)
            if name in batch:
                first = next(k for k in metrics if self._names.get(k) == name)
                if (first, key) not in self._reported:
                    self._reported.add((first, key))
                    note(f"metrics {first!r} and {key!r} both map to the MLflow metric {name!r}: {first!r} is kept")
                continue
            batch[name] = Metric(name, float(value), timestamp, step)
        if batch:
            self.client.log_batch(self.run_id, metrics=list(batch.values()))

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        if self.client is None or self.run_id is None or not samples:
            return
        columns, rows = sample_table(samples)
        table = {"columns": columns, "data": [[_json_cell(v) for v in row] for row in rows]}
        artifact = posixpath.join("samples", f"step_{step:08d}.json")
        self.client.log_text(self.run_id, json.dumps(table, allow_nan=False, default=str), artifact)

    def close(self) -> None:
        error = sys.exc_info()[1]  # the exception propagating through the trainer's ``finally``, if any
        if error is None:
            self._end("FINISHED")
        elif isinstance(error, TrainingInterrupted) or not isinstance(error, Exception):  # SIGINT, SIGTERM
            self._end("KILLED")
        else:
            self._end("FAILED")

    def _end(self, status: str) -> None:
        if self.client is None or self.run_id is None:
            return
        run_id, self.run_id = self.run_id, None
        self.client.set_terminated(run_id, status=status)
