"""Model sources (:mod:`core_rl.roles.model_sources`): where the files of a ``model_path`` or
``tokenizer_path`` come from. A third party's source registered in-process turns its paths into a
directory a whole run configuration then validates with, asked in the order of the sources' names; a
source's one-line error is a configuration problem naming the key path, the source and its
distribution, and its bug a fault naming it; a ``.gguf`` path with no source that reads it installed
is one line with the install command (``core-rl config validate``: exit status 2, no traceback; the
real-model fixture: unavailable, saying so), and one whose source is blocked says so. Sources load
only when a configuration names a model path."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from core_rl.config import load_config
from core_rl.errors import ConfigError, CoreRLError, PluginFault
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import ModelSource
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ALL_KINDS, KNOWN_EXTRAS, MODEL_SOURCE
from core_rl.roles.model_sources import KNOWN_MODEL_FILES, resolve_model_path, resolve_model_paths
from core_rl.testing.faults import build_task, merged
from core_rl.testing.tiny import build_tiny_model

SCHEME = "bucket://"
DISTRIBUTION = "core-rl-bucket-source"

#: the start of a program run as if core-rl-gguf were not installed: its entry points are not seen
HIDING_GGUF = """
import importlib.metadata as md, sys
installed = md.entry_points
seen = md.EntryPoints(
    ep for group in installed().groups for ep in installed(group=group)
    if ep.dist is None or ep.dist.name != "core-rl-gguf"
)
md.entry_points = lambda **select: seen.select(**select)
"""
#: ``core-rl ARGS`` without core-rl-gguf
CLI_WITHOUT_GGUF = HIDING_GGUF + "from core_rl.cli import main\nsys.exit(main(sys.argv[1:]))\n"
#: why the real model is unavailable without core-rl-gguf
REAL_MODEL_WITHOUT_GGUF = HIDING_GGUF + "from core_rl.testing import real_model\nprint(real_model.unavailable())\n"


class BucketSource(ModelSource):
    """A third party's source: ``bucket://<name>`` is a model "downloaded" into ``root/<name>``, built
    (as a tiny model) on the first request; ``bucket://denied/...`` is refused with a reason."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def resolve(self, path: str, notify: Callable[[str], None] | None = None) -> str | None:
        if not path.startswith(SCHEME):
            return None
        name = path.removeprefix(SCHEME)
        if name.startswith("denied/"):
            raise CoreRLError(f"{path}: access denied by the bucket's policy")
        target = self.root / name
        if not target.is_dir():
            if notify is not None:
                notify(f"downloading {path} into {target}")
            build_tiny_model(target, alphabet="abcd=", seed=0)
        return str(target)


class Everything(ModelSource):
    """Claims every bucket path with a directory of its own, to show which source is asked first."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def resolve(self, path: str, notify: Callable[[str], None] | None = None) -> str | None:
        return str(self.directory) if path.startswith(SCHEME) else None


def bucket_host(root: Path, *, also: dict[str, ModelSource] | None = None) -> PluginHost:
    """The installed plugins, plus the bucket source (and ``also``: name -> source) registered in-process."""

    class Plugin:
        @hookimpl
        def core_rl_register_model_sources(self, register: Register) -> None:
            register("bucket", lambda: BucketSource(root), description="models from a bucket")
            for name, source in (also or {}).items():
                register(name, lambda source=source: source, description="another source")

    host = PluginHost()
    host.register_plugin(Plugin(), distribution=DISTRIBUTION, version="2.0")
    return host


def write_config(tmp_path: Path, **actor: str) -> Path:
    """The tiny task's whole GRPO run (:func:`core_rl.testing.faults.build_task`) with ``actor`` keys replaced."""
    config = build_task(tmp_path / "task")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(merged(config, actor=actor)))
    return path


def test_a_third_party_source_resolves_the_model_paths_of_a_loaded_config(tmp_path: Path) -> None:
    notes: list[str] = []
    config = write_config(tmp_path, model_path="bucket://tiny", tokenizer_path="bucket://tiny")
    cfg = load_config(config, host=bucket_host(tmp_path / "bucket"), notify=notes.append)
    assert cfg.actor.model_path == cfg.actor.tokenizer_path == str(tmp_path / "bucket" / "tiny")
    assert notes == [f"downloading bucket://tiny into {tmp_path / 'bucket' / 'tiny'}"]  # once: cached after
    # paths no source claims stay as they are, at any depth, lists included
    hub = {"model_path": "org/hub-model", "tokenizer_path": ""}
    data = {"roles": [{"model_path": "bucket://tiny"}, dict(hub)]}
    assert resolve_model_paths(data, bucket_host(tmp_path / "bucket")) == []
    assert data == {"roles": [{"model_path": str(tmp_path / "bucket" / "tiny")}, hub]}


def test_sources_are_asked_in_the_order_of_their_names(tmp_path: Path) -> None:
    first, last = tmp_path / "first", tmp_path / "last"
    host = bucket_host(tmp_path / "bucket", also={"aaa": Everything(first), "zzz": Everything(last)})
    assert resolve_model_path("bucket://tiny", host=host) == str(first)


def test_a_sources_error_is_a_problem_naming_the_key_the_source_and_its_distribution(tmp_path: Path) -> None:
    config = write_config(tmp_path, model_path="bucket://denied/model")
    with pytest.raises(ConfigError) as raised:
        load_config(config, host=bucket_host(tmp_path / "bucket"))
    (problem,) = raised.value.problems
    assert problem.startswith(
        f"actor.model_path: model source 'bucket' (distribution {DISTRIBUTION} 2.0): "
        "bucket://denied/model: access denied by the bucket's policy"
    ), problem
    assert raised.value.exit_code == 2


@pytest.mark.parametrize(
    ("resolve", "fault"),
    [
        (lambda path, notify: 1 / 0, "failed while resolving actor.model_path 'bucket://x': ZeroDivisionError"),
        (lambda path, notify: 42, "returned int for actor.model_path 'bucket://x'; ModelSource.resolve returns"),
    ],
    ids=["raises", "returns-no-path"],
)
def test_a_sources_bug_is_a_fault_naming_it(tmp_path: Path, resolve: Callable[..., object], fault: str) -> None:
    class Buggy(ModelSource):
        def resolve(self, path: str, notify: Callable[[str], None] | None = None) -> str | None:
            return resolve(path, notify)  # type: ignore[return-value]

    host = bucket_host(tmp_path, also={"broken": Buggy()})  # asked before 'bucket'
    with pytest.raises(PluginFault, match=f"^model source 'broken' \\(distribution {DISTRIBUTION} 2.0\\) ") as raised:
        resolve_model_paths({"actor": {"model_path": "bucket://x"}}, host)
    assert fault in str(raised.value)


def _host_without(distribution: str, environ: dict[str, str] | None = None) -> PluginHost:
    """A host of the installed plugins but ``distribution``'s (as if it were not installed)."""
    installed = md.entry_points()
    groups = {kind.group for kind in ALL_KINDS}
    seen = [
        ep
        for group in groups
        for ep in installed.select(group=group)
        if ep.dist is None or ep.dist.name != distribution
    ]
    return PluginHost(entry_points=seen, environ=environ or {})


def test_a_gguf_path_without_the_gguf_source_says_what_to_install(tmp_path: Path) -> None:
    model = tmp_path / "SmolLM2.Q4_1.gguf"
    model.write_bytes(b"GGUF")  # never read: nothing here reads it
    config = write_config(tmp_path, model_path=str(model))
    with pytest.raises(ConfigError) as raised:
        load_config(config, host=_host_without("core-rl-gguf"))
    (problem,) = raised.value.problems
    assert problem.startswith(
        f"actor.model_path: no installed model source reads '{model}'; model source 'gguf' is not installed "
        '(installed: none); install it with: pip install "core-rl[gguf]"'
    ), problem


def test_core_rl_config_validate_of_a_gguf_path_without_the_source_is_one_line_and_exit_2(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = write_config(tmp_path, model_path=str(model))
    proc = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_GGUF, "config", "validate", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"actor.model_path: no installed model source reads '{model}'" in proc.stderr
    assert 'install it with: pip install "core-rl[gguf]"' in proc.stderr


def test_the_real_model_without_the_gguf_source_is_unavailable_saying_what_to_install() -> None:
    """The ``real_model`` fixture then skips with this reason (its GGUF file downloaded already: no
    registry reached here)."""
    from core_rl.testing import real_model as real

    gguf_file = real.cached_gguf()
    if gguf_file is None:
        pytest.skip(f"the real model's GGUF file is not cached here ({real.DESCRIPTION})")
    proc = subprocess.run([sys.executable, "-c", REAL_MODEL_WITHOUT_GGUF], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"the real model: no installed model source reads '{gguf_file}'; model source 'gguf' is not installed "
        '(installed: none); install it with: pip install "core-rl[gguf]"'
    )


def test_a_gguf_path_whose_source_is_blocked_says_so(tmp_path: Path) -> None:
    pytest.importorskip("core_rl_gguf")
    host = PluginHost(environ={"CORE_RL_PLUGINS_BLOCK": "core-rl-gguf"})
    (problem,) = resolve_model_paths({"critic": {"model_path": str(tmp_path / "x.gguf")}}, host)
    assert problem.startswith(f"critic.model_path: no installed model source reads '{tmp_path / 'x.gguf'}'; ")
    assert "model source 'gguf' is provided by core-rl-gguf, which is blocked by CORE_RL_PLUGINS_BLOCK" in problem


def test_sources_load_only_for_a_configuration_naming_a_model_path(tmp_path: Path) -> None:
    host = bucket_host(tmp_path)
    assert resolve_model_paths({"actor": {"model_path": ""}, "data": {"train_files": ["x.jsonl"]}}, host) == []
    installed = [s for s in host.statuses() if s.kind == MODEL_SOURCE and s.distribution != DISTRIBUTION]
    assert installed and {s.status for s in installed} == {"not loaded"}
    resolve_model_paths({"actor": {"model_path": "org/hub-model"}}, host)
    assert {s.status for s in host.statuses() if s.kind == MODEL_SOURCE} == {"loaded"}


def test_every_known_model_file_names_a_source_an_extra_installs() -> None:
    assert all((MODEL_SOURCE.key, name) in KNOWN_EXTRAS for name in KNOWN_MODEL_FILES.values())
