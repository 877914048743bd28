"""Commands that do not use a heavy backend never import it: ``core-rl plugins`` (which loads every
plugin), ``config validate`` and a whole ``train`` run on fsdp + hf (building its tiny model and
exporting the trained one) leave ``deepspeed``, ``megatron``, ``vllm`` and ``sglang`` out of
``sys.modules`` and print no DeepSpeed accelerator warning. Listing the plugins, and validating
every example configuration, import neither torch nor transformers (registering a plugin imports
no backend; ``config validate`` takes under a second). Each command runs in a fresh process, which
writes the heavy modules it imported to a file when it exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

BACKENDS = ("deepspeed", "megatron", "vllm", "sglang")
HEAVY = (*BACKENDS, "transformers", "torch")
DEEPSPEED_WARNING = "Setting accelerator to"

#: run ``core-rl ARGS`` (or, with ``--build-task DIR`` first, build the tiny task there first), then
#: record the heavy top-level modules imported, whatever the exit
RUNNER = """
import atexit, json, sys
HEAVY, REPORT = {heavy!r}, {report!r}
imported = lambda: sorted({{m.split(".")[0] for m in sys.modules}} & set(HEAVY))
atexit.register(lambda: open(REPORT, "w").write(json.dumps(imported())))
args = sys.argv[1:]
if args[0] == "--build-task":
    from pathlib import Path
    import yaml
    from core_rl.testing.faults import build_task, merged
    root = Path(args[1])
    config = merged(build_task(root), trainer={{"total_steps": 1}}, saver={{"export_hf": True}})
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    args = args[2:]
from core_rl.cli import main
sys.exit(main(args))
"""


def run_cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``core-rl ARGS`` in a fresh process: the completed process and the heavy modules it imported."""
    report = tmp_path / "imported.json"
    code = RUNNER.format(heavy=HEAVY, report=str(report))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)
    return proc, json.loads(report.read_text())


def test_listing_every_plugin_imports_no_heavy_backend(tmp_path: Path) -> None:
    proc, imported = run_cli(tmp_path, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {row["name"] for row in json.loads(proc.stdout)} >= set(BACKENDS)
    assert imported == []
    assert DEEPSPEED_WARNING not in proc.stderr


def test_a_run_without_deepspeed_never_imports_it(tmp_path: Path) -> None:
    """Building the tiny model, validating the run, and training it with a final export (transformers'
    ``save_pretrained`` looks for DeepSpeed through accelerate whenever it is installed)."""
    proc, imported = run_cli(tmp_path, "--build-task", str(tmp_path), "config", "validate", str(tmp_path / "run.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert set(imported) & set(BACKENDS) == set()
    assert DEEPSPEED_WARNING not in proc.stderr
    proc, imported = run_cli(tmp_path, "train", str(tmp_path / "run.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert (Path(config["experiment"]["output_dir"]) / "run" / "final_hf" / "model.safetensors").is_file()
    assert imported == ["torch", "transformers"]
    assert DEEPSPEED_WARNING not in proc.stderr


#: validate every example configuration in one process; the machine counts as having no GPU device
#: node, so that counting GPUs (the one thing validation asks torch) needs no torch on a GPU machine
#: either; then count them as if it had one, which asks torch
VALIDATE_EXAMPLES = """
import contextlib, io, json, sys
import core_rl.config.checks as checks
from core_rl.cli import main
checks.GPU_DEVICE_NODES = ()
codes, errors = {{}}, {{}}
for path in sys.argv[1:]:
    with contextlib.redirect_stderr(io.StringIO()) as err:
        codes[path] = main(["config", "validate", path])
    errors[path] = err.getvalue()
    sys.stderr.write(errors[path])
imported = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
checks.GPU_DEVICE_NODES = (sys.executable,)
gpus = checks.visible_gpus()
asked = "torch" in sys.modules
import torch
report = {{"codes": codes, "errors": errors, "imported": imported, "gpus": gpus, "asked_torch": asked}}
print(json.dumps({{**report, "torch_gpus": torch.cuda.device_count()}}))
"""


def test_validating_every_example_imports_no_torch(tmp_path: Path) -> None:
    examples = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "examples").glob("*/*.yaml"))
    assert len(examples) >= 20
    code = VALIDATE_EXAMPLES.format(heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", code, *examples], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    absent = _absent_plugins()
    refused = {path for path, code in report["codes"].items() if code != 0}
    # where this machine's install left plugins out, an example selecting one is refused ("is not installed")
    excused = {path for path in refused if absent and "is not installed" in report["errors"][path]}
    assert refused == excused, proc.stderr[-3000:]
    assert report["imported"] == []
    assert report["asked_torch"] and report["gpus"] == report["torch_gpus"]
    if excused:
        names = ", ".join(Path(p).name for p in sorted(excused))
        pytest.skip(f"{', '.join(absent)} not installed here: {names} not validated (the others were)")


def _absent_plugins() -> list[str]:
    """The in-repo plugins' distributions that are not installed in this interpreter."""
    import importlib.metadata

    import packaging_utils as pu

    absent = []
    for project in pu.plugin_project_dirs():
        name = pu.distribution_name(project)
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    return absent


def test_saving_a_model_keeps_checking_for_deepspeed_once_it_is_imported() -> None:
    """With DeepSpeed imported, accelerate's check is left alone (a DeepSpeed engine is then
    unwrapped as before)."""
    pytest.importorskip("deepspeed")
    code = (
        "import deepspeed, accelerate.utils.other as other\n"
        "from core_rl.roles.hf import _deepspeed_unprobed\n"
        "probe = other.is_deepspeed_available\n"
        "with _deepspeed_unprobed():\n"
        "    assert other.is_deepspeed_available is probe and probe()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
