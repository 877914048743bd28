"""Server environments: the virtual environments inference servers (vLLM, SGLang, ...) run from.

Inference servers pin torch, transformers and each other's dependencies incompatibly, so they never
enter the trainer's environment. A server plugin declares its environment with a
:class:`ServerEnvSpec` (registered through ``core_rl_register_server_envs``); :func:`create` builds
it as a venv under ``$CORE_RL_HOME/server-envs/<name>-<variant>-<hash>`` (``CORE_RL_HOME`` defaults
to ``~/.cache/core-rl``), where ``hash`` covers the spec's install steps and the base interpreter's
version, so a changed spec builds a new environment and an unchanged one is reused at once.

A finished environment holds ``core-rl-env.json`` (the manifest: name, variant, hash, interpreter,
installer, steps, how long the build took) and ``requirements.lock`` (``pip freeze`` of what was
installed). A directory without a manifest is an interrupted build and is rebuilt.

Steps written as ``python -m pip install|uninstall ...`` run through ``uv pip`` when uv is
installed (a core dependency; several times faster than pip, mostly from parallel downloads),
with pip's configured indexes and find-links passed on, since uv does not read pip's
configuration. ``CORE_RL_SERVER_ENV_INSTALLER=pip`` keeps pip.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from core_rl.interfaces.servers import ServerEnvError, ServerEnvSpec

from core_rl_server_kit.pip_as_uv import pip_settings_as_uv_flags

MANIFEST = "core-rl-env.json"
LOCK_FILE = "requirements.lock"
VARIANTS = ("cpu", "cuda")
ENV_HOME = "CORE_RL_HOME"


def home() -> Path:
    """``$CORE_RL_HOME`` or ``~/.cache/core-rl``."""
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".cache" / "core-rl")


def envs_root() -> Path:
    return home() / "server-envs"


def default_variant() -> str:
    """``cuda`` where an NVIDIA driver is visible (``nvidia-smi`` on the PATH), else ``cpu``."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def _python_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise ServerEnvError(f"cannot run the base interpreter {python!r}: {out.stderr.strip()}")
    return out.stdout.strip()


REQUIREMENT_FILE_FLAGS = ("-r", "--requirement", "-c", "--constraint")


def _is_pip(step: list[str]) -> bool:
    return step[:2] == ["-m", "pip"]


def _files_named(steps: list[list[str]]) -> list[str]:
    """Contents of the requirement and constraint files the steps name (pip's ``-r``/``-c``)."""
    contents = []
    for step in steps:
        if not _is_pip(step):
            continue
        for flag, value in itertools.pairwise(step):
            if flag in REQUIREMENT_FILE_FLAGS:
                try:
                    contents.append(Path(value).read_text(encoding="utf-8"))
                except OSError as exc:
                    raise ServerEnvError(f"cannot read requirement file {value}: {exc}") from None
    return contents


def spec_hash(spec: ServerEnvSpec, variant: str, python_version: str) -> str:
    """12 hex digits of sha256 over the variant's steps (with the contents of the requirement
    files they name), the revision, the check and the Python version."""
    steps = spec.steps_for(variant)
    # a requirement file counts by its name and contents, not by where this checkout keeps it
    portable = [
        [
            Path(arg).name if _is_pip(step) and i and step[i - 1] in REQUIREMENT_FILE_FLAGS else arg
            for i, arg in enumerate(step)
        ]
        for step in steps
    ]
    payload = json.dumps(
        {
            "steps": portable,
            "files": _files_named(steps),
            "revision": spec.revision,
            "python": python_version,
            "check": spec.check,
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def env_dir(spec: ServerEnvSpec, variant: str, python: str | None = None) -> Path:
    """Where the environment for ``spec``/``variant`` built from ``python`` lives."""
    version = _python_version(python or sys.executable)
    return envs_root() / f"{spec.name}-{variant}-{spec_hash(spec, variant, version)}"


def env_python(directory: Path) -> Path:
    return directory / "bin" / "python"


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a finished environment, or ``None``."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialise builds of one environment across processes."""
    envs_root().mkdir(parents=True, exist_ok=True)
    with open(envs_root() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


INSTALLER_ENV = "CORE_RL_SERVER_ENV_INSTALLER"


def uv_binary() -> str | None:
    """The uv executable to install with, or ``None`` (not installed, or pip asked for)."""
    if os.environ.get(INSTALLER_ENV, "").lower() == "pip":
        return None
    try:
        from uv import find_uv_bin  # the uv wheel ships its binary and this locator
    except ImportError:
        return shutil.which("uv")
    try:
        return find_uv_bin()
    except FileNotFoundError:
        return shutil.which("uv")


def installer_command(step: list[str], python: str, uv: str | None, uv_flags: list[str]) -> list[str]:
    """The command that carries out ``step`` with the environment's interpreter ``python``:
    ``python -m pip install ARGS`` becomes ``uv pip install --python python ... ARGS`` when uv
    is available; every other step runs as written."""
    if uv is None or not _is_pip(step) or len(step) < 3 or step[2] not in ("install", "uninstall"):
        return [python, *step]
    action, args = step[2], [a for a in step[3:] if a not in ("--disable-pip-version-check", "--no-input")]
    if action == "uninstall":
        return [uv, "pip", "uninstall", "--python", python, *[a for a in args if a not in ("-y", "--yes")]]
    # pip takes the best version across every index; uv's default stops at the first index that has the name
    return [
        uv,
        "pip",
        "install",
        "--python",
        python,
        "--index-strategy",
        "unsafe-best-match",
        *uv_flags,
        *args,
    ]


def _run(cmd: list[str], log: Path, what: str, timeout: float) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ServerEnvError(f"{what} took longer than {timeout:.0f} s; see {log}") from None
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
        raise ServerEnvError(f"{what} failed (exit {proc.returncode}); see {log}; last lines:\n{tail}")


def create(
    spec: ServerEnvSpec,
    *,
    variant: str | None = None,
    python: str | None = None,
    force: bool = False,
    step_timeout: float = 1800.0,
    echo: Callable[[str], None] | None = None,
) -> Path:
    """Build the environment (or reuse the finished one) and return its directory.

    ``variant``: ``cpu`` or ``cuda`` (default :func:`default_variant`); ``python``: the base
    interpreter for ``python -m venv`` (default: this one); ``force``: rebuild even if finished.
    Each step may take ``step_timeout`` seconds. Raises :class:`ServerEnvError` naming the step
    that failed and the build log.
    """
    variant = variant or default_variant()
    base = python or sys.executable
    directory = env_dir(spec, variant, base)
    say = echo or (lambda _msg: None)
    with _locked(spec.name):
        if not force and read_manifest(directory) is not None:
            return directory
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        log = directory / "build.log"
        start = time.monotonic()
        say(f"building server environment {spec.name} ({variant}) in {directory}; log: {log}")
        _run([base, "-m", "venv", str(directory)], log, f"creating the venv {directory}", step_timeout)
        py = str(env_python(directory))
        uv = uv_binary()
        uv_flags = pip_settings_as_uv_flags(py) if uv else []
        for i, step in enumerate(spec.steps_for(variant), 1):
            say(f"  step {i}: python {' '.join(step)}")
            cmd = installer_command(step, py, uv, uv_flags)
            _run(cmd, log, f"step {i} of {spec.name} ({' '.join(step)})", step_timeout)
        if spec.post_install is not None:
            spec.post_install(directory)
        if spec.check:
            _run([py, "-c", spec.check], log, f"the check of {spec.name}", step_timeout)
        freeze = subprocess.run(
            [py, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=300, check=False
        )
        (directory / LOCK_FILE).write_text(freeze.stdout, encoding="utf-8")
        manifest = {
            "name": spec.name,
            "variant": variant,
            "hash": directory.name.rsplit("-", 1)[-1],
            "base_python": base,
            "installer": "uv" if uv else "pip",
            "python_version": _python_version(py),
            "steps": spec.steps_for(variant),
            "revision": spec.revision,
            "build_seconds": round(time.monotonic() - start, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        tmp.replace(directory / MANIFEST)  # written last: its presence means "finished"
        say(f"built {spec.name} in {manifest['build_seconds']:.0f} s")
        return directory


def find(spec: ServerEnvSpec, *, variant: str | None = None, python: str | None = None) -> Path | None:
    """The finished environment for ``spec`` (same steps, same base Python), or ``None``."""
    directory = env_dir(spec, variant or default_variant(), python)
    return directory if read_manifest(directory) is not None else None


def list_envs() -> list[tuple[Path, dict]]:
    """Every finished environment under :func:`envs_root` with its manifest, by directory name."""
    root = envs_root()
    if not root.is_dir():
        return []
    out = []
    for directory in sorted(root.iterdir()):
        manifest = read_manifest(directory) if directory.is_dir() else None
        if manifest is not None:
            out.append((directory, manifest))
    return out


def remove(name: str) -> list[Path]:
    """Delete every environment (any variant, any hash) named ``name``; return what was removed."""
    removed = []
    with _locked(name):
        root = envs_root()
        for directory in sorted(root.glob(f"{name}-*")) if root.is_dir() else []:
            manifest = read_manifest(directory)
            if directory.is_dir() and (manifest is None or manifest.get("name") == name):
                shutil.rmtree(directory)
                removed.append(directory)
    return removed


# -- the ``core-rl server-env`` command ------------------------------------------------------------


def add_command(sub: object) -> argparse.ArgumentParser:
    """Add ``server-env create|list|path|remove`` to the CLI's subparsers ``sub``; return its parser."""
    parser = sub.add_parser(  # type: ignore[attr-defined]
        "server-env",
        help="build and manage inference-server environments",
        description="Build, list, locate or remove the virtual environments inference servers run from "
        f"(under ${ENV_HOME}/server-envs, default ~/.cache/core-rl/server-envs).",
    )
    actions = parser.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    create_p = actions.add_parser("create", help="build an environment (instant if already built)")
    create_p.add_argument("name", help="a registered server environment, e.g. vllm or sglang")
    create_p.add_argument("--variant", choices=VARIANTS, help="cpu or cuda (default: cuda if nvidia-smi exists)")
    create_p.add_argument("--python", help="base interpreter for the venv (default: this one)")
    create_p.add_argument("--force", action="store_true", help="rebuild even if it exists")
    actions.add_parser("list", help="list registered and built environments")
    path_p = actions.add_parser("path", help="print the interpreter of a built environment")
    path_p.add_argument("name")
    path_p.add_argument("--variant", choices=VARIANTS)
    path_p.add_argument("--python", help="the base interpreter it was built from (default: this one)")
    remove_p = actions.add_parser("remove", help="delete every built environment of a name")
    remove_p.add_argument("name")
    return parser


def get_spec(name: str, host: object | None = None) -> ServerEnvSpec:
    """The registered :class:`ServerEnvSpec` ``name`` (loading only the plugin that declares it)."""
    from core_rl.plugins import SERVER_ENV, PluginHost, build_component

    host = host or PluginHost()
    return build_component(host.get(SERVER_ENV, name))  # type: ignore[attr-defined]


def run_command(args: object) -> int:
    """Carry out a parsed ``server-env`` command; return the exit status."""
    action = args.env_command  # type: ignore[attr-defined]
    if action == "create":
        spec = get_spec(args.name)  # type: ignore[attr-defined]
        directory = create(
            spec,
            variant=args.variant,  # type: ignore[attr-defined]
            python=args.python,  # type: ignore[attr-defined]
            force=args.force,  # type: ignore[attr-defined]
            echo=lambda msg: print(msg, flush=True),
        )
        print(env_python(directory))
        return 0
    if action == "path":
        spec = get_spec(args.name)  # type: ignore[attr-defined]
        found = find(spec, variant=args.variant, python=args.python)  # type: ignore[attr-defined]
        if found is None:
            raise ServerEnvError(
                f"server environment {spec.name!r} is not built; run: core-rl server-env create {spec.name}"
            )
        print(env_python(found))
        return 0
    if action == "list":
        from core_rl.plugins import SERVER_ENV, PluginHost

        host = PluginHost()
        host.load_all()
        for entry in host.registries[SERVER_ENV.key]:
            print(f"{entry.name}: {entry.description} ({entry.distribution})")
        for directory, manifest in list_envs():
            print(
                f"  {manifest['name']} {manifest['variant']} python {manifest.get('python_version', '?')}: {directory}"
            )
        return 0
    if action == "remove":
        removed = remove(args.name)  # type: ignore[attr-defined]
        for directory in removed:
            print(f"removed {directory}")
        if not removed:
            print(f"no built environment named {args.name!r}")  # type: ignore[attr-defined]
        return 0
    raise ServerEnvError(f"unknown server-env action {action!r}")
