"""The ``mlflow`` logger against a real local MLflow store (sqlite, under a temporary directory),
read back with ``MlflowClient``: conformance; metrics at their steps, params, tags, sample tables
and the run's status; the name mapping; continuing the MLflow run on resume; and a real
``core-rl train`` that crashes, is resumed, and leaves one MLflow run whose history is the run's
``metrics.jsonl``."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

if importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("core_rl_mlflow") is None:
    pytest.skip("the mlflow package or core-rl-mlflow is not installed", allow_module_level=True)

import core_rl_mlflow.plugin
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.config.validators import FieldValueError
from core_rl.errors import CoreRLError
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl.loops.errors import TrainingInterrupted
from core_rl.testing import LoggerContract
from core_rl_mlflow.logger import RUN_FILE, TRUNCATED, MlflowLogger, flatten_config, mlflow_name
from core_rl_mlflow.plugin import MlflowConfig, is_mlflow_name
from hypothesis import given
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, _validate_metric_name


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the module (creating its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _local_store(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's environment points at the module's store; the working directory (where a local store
    puts artifacts by default) is the test's own."""
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.chdir(tmp_path)


class TestMlflowContract(LoggerContract):
    plugin = core_rl_mlflow.plugin
    name = "mlflow"
    distribution = "core-rl-mlflow"
    options: ClassVar[dict[str, Any]] = {"experiment_name": "contract"}


def _info(tmp_path: Path, config: dict[str, Any] | None = None, resume_step: int | None = None) -> RunInfo:
    return RunInfo(name="demo", output_dir=tmp_path / "run", config=config or {"seed": 1}, resume_step=resume_step)


def test_metrics_params_tags_and_samples_read_back(store, tmp_path, capfd):
    config = {
        "trainer": {"total_steps": 3},
        "actor": {"optimizer": {"lr": 0.01, "betas": [0.9, 0.99]}, "lora": {}},
        "data": {"note": "x" * (MAX_PARAM_VAL_LENGTH + 10), "prompt_key": None},
        "reward": {"weights": {"pass@1": 0.5}},
    }
    lg = MlflowLogger(MlflowConfig(experiment_name="read-back", tags={"team": "rl"}))
    lg.start(_info(tmp_path, config))
    for step in (1, 2, 3):
        lg.log({"reward/mean": step / 8, "eval/pass@1": step / 4, "actor/grad_norm": 1.0}, step)
    lg.log({"actor/grad_norm": float("nan"), "actor/loss": float("inf")}, 4)
    samples = [
        SampleRecord("abc=", "cba", 1.0, "stop", {"match": 1.0}),
        SampleRecord("p|q", "", float("nan"), "length", info={"turns": 2}),
    ]
    lg.log_samples(samples, 3)
    lg.close()

    client = MlflowClient(store)
    (record,) = [json.loads((tmp_path / "run" / RUN_FILE).read_text())]
    assert record["tracking_uri"] == store
    run = client.get_run(record["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert client.get_experiment(run.info.experiment_id).name == "read-back"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics
    }
    assert history["reward/mean"] == [(1, 0.125), (2, 0.25), (3, 0.375)]
    assert history["eval/pass_at_1"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history["actor/grad_norm"][:3] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert history["actor/grad_norm"][3][0] == 4 and math.isnan(history["actor/grad_norm"][3][1])
    assert history["actor/loss"][0][0] == 4 and history["actor/loss"][0][1] > 1e300  # +inf: MLflow's largest float
    params = run.data.params
    assert params["trainer.total_steps"] == "3"
    assert params["actor.optimizer.lr"] == "0.01"
    assert params["actor.optimizer.betas"] == "[0.9, 0.99]"
    assert params["actor.lora"] == "{}" and params["data.prompt_key"] == "None"
    assert params["reward.weights.pass_at_1"] == "0.5"
    assert len(params["data.note"]) == MAX_PARAM_VAL_LENGTH and params["data.note"].endswith(TRUNCATED)
    assert f"were cut, ending in {TRUNCATED!r}: data.note" in capfd.readouterr().err
    assert run.data.tags["team"] == "rl" and run.data.tags["core_rl.run_dir"] == str(tmp_path / "run")
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == ["samples/step_00000003.json"]
    # a local store keeps artifacts in ./mlruns (of the working directory when this process first opened the
    # store: a test's, here)
    assert run.info.artifact_uri.startswith(str(tmp_path.parent)) and "/mlruns/" in run.info.artifact_uri
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples/step_00000003.json", str(tmp_path))).read_text()
    )
    assert table == {
        "columns": ["prompt", "response", "reward", "finish_reason", "reward/match", "info/turns"],
        "data": [["abc=", "cba", 1.0, "stop", 1.0, None], ["p|q", "", "nan", "length", None, 2]],
    }


def test_close_during_an_error_fails_the_run_and_during_an_interruption_kills_it(store, tmp_path):
    client = MlflowClient(store)
    for error, status in [(RuntimeError("step 2 broke"), "FAILED"), (TrainingInterrupted("SIGTERM"), "KILLED")]:
        lg = MlflowLogger(MlflowConfig(experiment_name="status"))
        lg.start(_info(tmp_path / status))
        run_id = lg.run_id
        with pytest.raises(type(error)):
            try:
                raise error
            finally:  # as the trainer closes its loggers
                lg.close()
        assert client.get_run(run_id).info.status == status
    lg.close()  # closed already: nothing happens


def test_resume_continues_the_recorded_run_or_says_why_not(store, tmp_path, capfd):
    client = MlflowClient(store)
    first = MlflowLogger(MlflowConfig(experiment_name="resume", tags={"a": "1"}))
    first.start(_info(tmp_path, {"trainer": {"total_steps": 2}, "seed": 1}))
    first.log({"reward/mean": 0.5}, 1)
    first.close()
    run_id = fresh_id(tmp_path)

    again = MlflowLogger(MlflowConfig(experiment_name="resume", tags={"a": "2"}))
    again.start(_info(tmp_path, {"trainer": {"total_steps": 4}, "seed": 1, "new": "x"}, resume_step=1))
    assert again.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    again.log({"reward/mean": 0.75}, 2)
    again.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(1, 0.5), (2, 0.75)]
    assert run.data.params == {"trainer.total_steps": "2", "seed": "1", "new": "x"}  # params keep their first values
    assert run.data.tags["a"] == "2" and run.data.tags["core_rl.resume_step"] == "1"
    assert "these changed on resume: trainer.total_steps" in capfd.readouterr().err

    # a fresh run in the same directory starts a new MLflow run
    fresh = MlflowLogger(MlflowConfig(experiment_name="resume"))
    fresh.start(_info(tmp_path))
    fresh.close()
    assert fresh_id(tmp_path) != run_id

    # the recorded run deleted: a new one, with a note
    client.delete_run(fresh_id(tmp_path))
    deleted = fresh_id(tmp_path)
    lg = MlflowLogger(MlflowConfig(experiment_name="resume"))
    lg.start(_info(tmp_path, resume_step=1))
    lg.close()
    assert fresh_id(tmp_path) != deleted
    assert (
        f"MLflow run {deleted} is not in {store} (or is deleted): starting a new MLflow run" in capfd.readouterr().err
    )

    # another store than the recorded one: a new run there, with a note
    other = f"sqlite:///{tmp_path / 'other.db'}"
    recorded = fresh_id(tmp_path)
    lg = MlflowLogger(MlflowConfig(tracking_uri=other, experiment_name="resume"))
    lg.start(_info(tmp_path, resume_step=1))
    lg.close()
    assert MlflowClient(other).get_run(fresh_id(tmp_path)).info.status == "FINISHED"
    assert f"the run's MLflow run {recorded} is in {store}, not in {other}" in capfd.readouterr().err

    # no record at all: a new run, with a note
    (tmp_path / "run" / RUN_FILE).unlink()
    lg = MlflowLogger(MlflowConfig(tracking_uri=other, experiment_name="resume"))
    lg.start(_info(tmp_path, resume_step=1))
    lg.close()
    assert "no MLflow run recorded in" in capfd.readouterr().err


def fresh_id(tmp_path: Path) -> str:
    return json.loads((tmp_path / "run" / RUN_FILE).read_text())["run_id"]


def test_defaults_come_from_mlflow_environment_and_the_run(store, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    lg = MlflowLogger(MlflowConfig())
    lg.start(_info(tmp_path))
    lg.close()
    run = MlflowClient(store).get_run(fresh_id(tmp_path))
    assert MlflowClient(store).get_experiment(run.info.experiment_id).name == "from-env"
    assert run.info.run_name == "demo"
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    lg = MlflowLogger(MlflowConfig(run_name="named", log_config=False, artifact_location=str(tmp_path / "art")))
    lg.start(_info(tmp_path / "second", {"seed": 1}))
    lg.log_samples([SampleRecord("a", "b", 0.0, "stop")], 1)
    lg.close()
    run = MlflowClient(store).get_run(fresh_id(tmp_path / "second"))
    assert MlflowClient(store).get_experiment(run.info.experiment_id).name == "core-rl"
    assert run.info.run_name == "named" and run.data.params == {}
    # the experiment this logger created keeps its artifacts in artifact_location
    assert run.info.artifact_uri.startswith(str(tmp_path / "art"))
    assert list((tmp_path / "art").rglob("samples/step_00000001.json"))


def test_a_store_that_cannot_be_opened_is_one_message(tmp_path):
    lg = MlflowLogger(MlflowConfig(tracking_uri="nosuchscheme://x"))
    with pytest.raises(CoreRLError, match="logger 'mlflow' could not start with tracking URI nosuchscheme://x: "):
        lg.start(_info(tmp_path))
    lg.close()


def test_a_deleted_experiment_is_one_message(store, tmp_path):
    client = MlflowClient(store)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(CoreRLError, match="the MLflow experiment 'gone' .* is deleted; restore it"):
        MlflowLogger(MlflowConfig(experiment_name="gone")).start(_info(tmp_path))


def test_colliding_metric_names_keep_the_first(store, tmp_path, capfd):
    lg = MlflowLogger(MlflowConfig(experiment_name="collide"))
    lg.start(_info(tmp_path))
    lg.log({"a=b": 1.0, "a#b": 2.0}, 1)
    lg.log({"a=b": 3.0, "a#b": 4.0}, 2)
    lg.close()
    history = MlflowClient(store).get_metric_history(fresh_id(tmp_path), "a_b")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 3.0)]
    err = capfd.readouterr().err
    assert err.count("metrics 'a=b' and 'a#b' both map to the MLflow metric 'a_b'") == 1


# -- names and params --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("reward/mean", "reward/mean"),
        ("eval/pass@1", "eval/pass_at_1"),
        ("eval/source=gsm8k/reward/mean", "eval/source_gsm8k/reward/mean"),
        ("timing/step (s)", "timing/step _s_"),
        ("a//b", "a/_/b"),
        ("/a/", "_/a/_"),
        ("a/./b/../c", "a/_/b/__/c"),
        ("..x", "_.x"),
        ("", "_"),
        ("ü/ok:1", "ü/ok:1"),
        ("x" * 300, "x" * 249),
        ("x" * 249 + "/abc", "x" * 249),
    ],
)
def test_mlflow_name(name, expected):
    assert mlflow_name(name) == expected


@given(st.text(max_size=300))
def test_mlflow_name_gives_names_mlflow_accepts(name):
    mapped = mlflow_name(name)
    assert is_mlflow_name(mapped) and len(mapped) <= 250
    _validate_metric_name(mapped)  # MLflow's own check
    assert mlflow_name(mapped) == mapped
    if is_mlflow_name(name):
        assert mapped == name


@given(st.text(alphabet="ab/.@: -_é", max_size=12))
def test_is_mlflow_name_agrees_with_mlflow(name):
    try:
        _validate_metric_name(name)
        accepted = True
    except Exception:
        accepted = False
    assert is_mlflow_name(name) == accepted


def test_flatten_config():
    assert flatten_config({"a": {"b": 1, "c": [1, "x"], "d": {}}, "e": None, "f": True, "g": "s"}) == {
        "a.b": "1",
        "a.c": '[1, "x"]',
        "a.d": "{}",
        "e": "None",
        "f": "True",
        "g": "s",
    }


LAZY = """
import sys
from core_rl.config.schema import PluginSpec
from core_rl.plugins.kinds import LOGGER
from core_rl.plugins.host import PluginHost
from core_rl.config.sections import validate_plugin_section
host = PluginHost()
spec = PluginSpec(name="mlflow", options={"tracking_uri": "sqlite:///x.db", "tags": {"a": "b"}})
validate_plugin_section(host, LOGGER, spec, "loggers[0]")
assert spec.config.tracking_uri == "sqlite:///x.db"
lg = host.get(LOGGER, "mlflow").factory(spec.config)
print("mlflow imported:", "mlflow" in sys.modules)
"""


def test_mlflow_is_imported_when_the_logger_is_built_not_when_registered():
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "mlflow imported: True"
    before = LAZY.replace('lg = host.get(LOGGER, "mlflow").factory(spec.config)\n', "")
    proc = subprocess.run([sys.executable, "-c", before], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "mlflow imported: False"


def test_tag_keys_must_be_mlflow_names():
    MlflowConfig(tags={"team": "rl", "mlflow.note.content": "text"})
    with pytest.raises(FieldValueError, match="keys must be MLflow tag names"):
        MlflowConfig(tags={"team@x": "rl"})


# -- a real run ----------------------------------------------------------------------------------

needs_training = pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None
        for m in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_reward_match")
    ),
    reason="needs the fsdp, hf, grpo and reward-match plugins",
)


def _cli(root: Path, config: dict[str, Any], *args: str, faults: bool = False) -> subprocess.CompletedProcess[str]:
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"OMP_NUM_THREADS": "1"}
    module = "core_rl.testing.faults" if faults else "core_rl.cli"
    return subprocess.run(
        [sys.executable, "-m", module, "train", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )


@needs_training
def test_train_crash_and_resume_keep_one_mlflow_run(tmp_path):
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="abcd=", seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("ab", "ba", "abc", "dc"))
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {
        "experiment": {"name": "run", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 4, "torch_threads": 1},
        "saver": {"every_n_steps": 2, "at_end": False},
        "sample_log": {"every_n_steps": 2, "num_samples": 2},
        "loggers": [
            {
                "name": "mlflow",
                "tracking_uri": uri,
                "experiment_name": "e2e",
                "tags": {"team": "rl"},
                "artifact_location": str(tmp_path / "artifacts"),
            },
            # after mlflow has logged step 3, the run fails: its checkpoint is step 2's
            {"name": "crash_once", "step": 3, "marker": str(tmp_path / "crashed")},
        ],
    }
    crashed = _cli(tmp_path, config, faults=True)
    assert crashed.returncode != 0 and "crash_once: logger crashed at step 3" in crashed.stderr, crashed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "run"
    run_id = json.loads((run_dir / RUN_FILE).read_text())["run_id"]
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]

    resumed = _cli(tmp_path, config, "trainer.resume=true", faults=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / RUN_FILE).read_text())["run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward/mean", "actor/loss", "response_length/mean"):
        history = client.get_metric_history(run_id, key)
        # step 3 again after the resume (MLflow's history is append-only); the later point is the run's
        assert [m.step for m in history] == [1, 2, 3, 3, 4], key
        latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
        assert latest == pytest.approx({r["step"]: r[key] for r in rows}), key
        assert run.data.metrics[key] == pytest.approx(rows[-1][key])
    assert run.data.params["experiment.name"] == "run" and run.data.params["algorithm.name"] == "grpo"
    assert run.data.params["loggers"].startswith('[{"name": "mlflow"')
    assert run.data.tags["team"] == "rl" and run.data.tags["core_rl.resume_step"] == "2"
    assert run.info.artifact_uri.startswith(str(tmp_path / "artifacts"))
    samples = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert samples == ["samples/step_00000002.json", "samples/step_00000004.json"]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"tracking_url": "sqlite:///x.db"}, "loggers[0].tracking_url: unknown key; did you mean 'tracking_uri'?"),
        ({"tags": {"a@b": "x"}}, "loggers[0].tags: keys must be MLflow tag names: "),
    ],
)
def test_a_bad_option_is_one_message_with_exit_2(tmp_path, option, message):
    config = {
        "actor": {"model_path": str(tmp_path / "model"), "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "char_match"},
        "data": {"train_files": [str(tmp_path / "train.jsonl")]},
        "loggers": [{"name": "mlflow", **option}],
    }
    proc = _cli(tmp_path, config)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith(message), proc.stderr
