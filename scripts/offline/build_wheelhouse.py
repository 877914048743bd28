"""Build a wheelhouse for installing core-rl on a machine without a package index (an air-gapped GPU
cluster, say) that already has Python and a CUDA build of torch.

Run it on a machine that reaches the package index; carry the folder over; install it there with
``scripts/offline/install.sh``. It holds:

- core-rl and every in-repo plugin as wheels (``pip wheel --no-deps``, in this environment when it
  has their build backend, else in an isolated one per project);
- every third-party distribution those need that the target lacks, at the versions a real resolver
  picks for the target's Python and Linux x86-64 (``uv pip compile``, with what the target has as
  constraints and pip's configured indexes): binary wheels for the target's Python version and
  platform, or the source package where a project publishes only that (DeepSpeed: the install
  script builds it without compiling any op);
- never torch, triton or NVIDIA's CUDA libraries: the target's own torch is used and left alone.

``--have FILE`` lists what the target already has, as ``python3 -m pip list --format=freeze``
prints it there (``name==version`` lines; a bare name means "present, version unknown"). Those
distributions are left out, which keeps the wheelhouse small. Where a listed version does not
satisfy what core-rl needs, the build stops and names the distribution, the version and the
requirement, since the install would fail there without an index to upgrade from.

``--with REQ`` (repeatable) carries another distribution and what it needs, installed beside
core-rl: ``--with trl==1.16.0`` brings TRL for ``benchmarks/gpu_grpo.py``'s comparison on a GPU
machine without an index (the benchmark then finds TRL in core-rl's own environment).

Usage::

    python3 scripts/offline/build_wheelhouse.py OUT [--have have.txt] [--python-version 3.12]
        [--extras all] [--test-tools] [--with REQ ...] [--resolve-only]

``OUT/requirements.txt`` is the resolved set (``--resolve-only`` writes it and stops, downloading
nothing). ``OUT/manifest.txt`` lists each file and which requirement brought it in; the install script
installs exactly those files. ``OUT/sources.txt`` holds the digest of the sources core-rl's own
wheels were built from: the install script refuses a wheelhouse whose digest is not its checkout's
(a wheelhouse built before a change would test the old code). Rebuilding into the same folder
fetches only what changed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sources_digest  # this folder's: the digest install.sh checks the checkout against

ROOT = Path(__file__).resolve().parents[2]
#: the digest of the sources core-rl's wheels were built from (scripts/offline/sources_digest.py)
SOURCES_FILE = "sources.txt"
#: manylinux tags the target's pip accepts (pip matches each exactly)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
#: what the test suite needs besides core-rl and its plugins: requirements-dev.txt's requirements but the
#: editable installs and the linter
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"
LINT_ONLY = {"ruff"}


def test_tools() -> list[str]:
    """The test suite's own requirements (pytest, its plugins, hypothesis, the OpenAI client, ...)."""
    lines = (line.split("#", 1)[0].strip() for line in DEV_REQUIREMENTS.read_text().splitlines())
    requirements = [line for line in lines if line and not line.startswith("-")]
    return list(dict.fromkeys(r for r in requirements if Requirement(r).name not in LINT_ONLY))


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be built as asked; the message says what and why."""


def our_projects() -> dict[str, Path]:
    """The core and every in-repo plugin (each a directory with a pyproject.toml), by name."""
    dirs = [ROOT, *sorted(p.parent for p in ROOT.glob("plugins/*/*/pyproject.toml"))]
    return {canonicalize_name(_pyproject(d)["project"]["name"]): d for d in dirs}


def _pyproject(directory: Path) -> dict:
    with (directory / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def selected_projects(extras: set[str]) -> dict[str, Path]:
    """core-rl and the in-repo plugins its ``extras`` name, with the plugins those depend on."""
    projects = our_projects()
    optional = _pyproject(ROOT)["project"].get("optional-dependencies", {})
    unknown = sorted(extras - set(optional))
    if unknown:
        raise WheelhouseError(f"core-rl has no extra {', '.join(unknown)}; its extras: {', '.join(sorted(optional))}")
    todo = [Requirement(r) for extra in sorted(extras) for r in optional[extra]]
    chosen = {"core-rl"}
    while todo:
        name = canonicalize_name(todo.pop().name)
        if name in projects and name not in chosen:
            chosen.add(name)
            todo.extend(Requirement(r) for r in _pyproject(projects[name])["project"].get("dependencies", []))
    return {name: projects[name] for name in sorted(chosen)}


def read_have(path: Path | None) -> dict[str, Version | None]:
    """``name -> version`` (``None``: present, version unknown) from a ``pip list --format=freeze``."""
    have: dict[str, Version | None] = {}
    if path is None:
        return have
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, _, version = line.partition("==")
        have[canonicalize_name(name.split("@", 1)[0].strip())] = Version(version.split("+", 1)[0]) if version else None
    return have


def metadata_requirements(path: Path) -> tuple[str, list[str]]:
    """(project name, Requires-Dist lines) of a wheel, or of a source package's PKG-INFO."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            text = zf.read(meta).decode()
    else:
        import tarfile

        with tarfile.open(path) as tf:
            member = next(m for m in tf.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
            handle = tf.extractfile(member)
            text = handle.read().decode() if handle else ""
    message = Parser().parsestr(text)
    return message["Name"], message.get_all("Requires-Dist") or []


def target_environment(python_version: str) -> dict[str, str]:
    env = default_environment()
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""}))


def torch_side(resolved: Sequence[tuple[str, str, str]]) -> set[str]:
    """The resolved distributions the target's torch brings: torch itself, triton, and whatever
    only those require (the resolver's ``via``: NVIDIA's CUDA libraries, sympy, ...). A
    distribution another one needs too, or one merely named like them (``nvidia-ml-py``, which a
    logger needs), is not."""
    vias = {name: {v.strip() for v in via.split(",") if v.strip()} for name, _, via in resolved}
    side = {name for name in vias if name in ("torch", "triton", "pytorch-triton")}
    grown = True
    while grown:
        grown = False
        for name, required_by in vias.items():
            if name not in side and required_by and required_by <= side:
                side.add(name)
                grown = True
    return side


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def backends_installed(projects: dict[str, Path]) -> bool:
    """Whether this interpreter already has every ``build-system.requires`` of ``projects`` (their
    build backend, hatchling) at a version they accept: then pip builds the wheels in this
    environment instead of a fresh isolated one per project (~6 s each, ~0.6 s without)."""
    for directory in projects.values():
        for text in _pyproject(directory).get("build-system", {}).get("requires", []):
            req = Requirement(text)
            try:
                version = Version(metadata.version(req.name))
            except metadata.PackageNotFoundError:
                return False
            if not req.specifier.contains(version, prereleases=True):
                return False
    return True


def build_our_wheels(out: Path, projects: dict[str, Path]) -> dict[str, Path]:
    """Wheels of ``projects`` (core-rl and the selected plugins); ``name -> wheel``."""
    for stale in out.glob("core_rl*.whl"):
        stale.unlink()
    isolation = ["--no-build-isolation"] if backends_installed(projects) else []
    proc = pip("wheel", "--no-deps", *isolation, "-q", "-w", str(out), *(str(d) for d in projects.values()))
    if proc.returncode != 0:
        raise WheelhouseError(f"building core-rl's wheels failed:\n{proc.stderr[-3000:]}")
    wheels = {}
    for wheel in out.glob("core_rl*.whl"):
        wheels[canonicalize_name(parse_wheel_filename(wheel.name)[0])] = wheel
    return wheels


def download(name: str, spec: SpecifierSet, python_version: str, out: Path) -> Path:
    """One distribution for the target: a binary wheel if there is one, else its source package (one
    already in ``out`` that satisfies ``spec`` is kept: rebuilding a wheelhouse fetches only what changed)."""
    for existing in out.iterdir():
        if existing.suffix in (".whl", ".gz") and not existing.name.startswith("core_rl"):
            if (
                file_name(existing) == name
                and spec.contains(file_version(existing), prereleases=True)
                and fits_target(existing, python_version)
            ):
                return existing
    requirement = f"{name}{spec}"
    with tempfile.TemporaryDirectory() as tmp:
        target = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
        for platform in PLATFORMS:
            target += ["--platform", platform]
        proc = pip("download", "--no-deps", "-q", "-d", tmp, *target, requirement)
        if proc.returncode != 0:
            proc = pip("download", "--no-deps", "-q", "--no-binary=:all:", "-d", tmp, requirement)
        if proc.returncode != 0:
            raise WheelhouseError(
                f"no wheel or source package of {requirement} for Python {python_version}:\n{proc.stderr[-2000:]}"
            )
        (got,) = Path(tmp).iterdir()
        final = out / got.name
        got.replace(final)
        return final


def fits_target(path: Path, python_version: str) -> bool:
    """Whether a wheel (or a source package, always) installs on the target's CPython
    ``python_version`` and Linux x86-64: a wheel kept from a build for another Python does not."""
    if path.suffix != ".whl":
        return True
    major, minor = (int(part) for part in python_version.split(".")[:2])
    exact = {f"cp{major}{minor}", f"py{major}{minor}", f"py{major}"}
    # the stable ABI (abi3) of CPython 3.k serves every 3.m with m >= k
    stable = {f"cp{major}{k}" for k in range(minor + 1)}

    def fits(tag: Tag) -> bool:
        if tag.platform not in PLATFORMS and tag.platform != "any":
            return False
        if tag.abi == "abi3":
            return tag.interpreter in stable
        return tag.interpreter in exact and tag.abi in ("none", f"cp{major}{minor}")

    return any(fits(tag) for tag in parse_wheel_filename(path.name)[3])


def _parsed(path: Path) -> tuple:
    return parse_wheel_filename(path.name) if path.suffix == ".whl" else parse_sdist_filename(path.name)


def file_name(path: Path) -> str:
    """The canonical project name of a wheel or source package file."""
    return canonicalize_name(_parsed(path)[0])


def file_version(path: Path) -> Version:
    return _parsed(path)[1]


#: the resolver's target platform: the newest manylinux tag of :data:`PLATFORMS`
RESOLVE_PLATFORM = "x86_64-manylinux_2_39"
#: a pinned line of ``uv pip compile``'s output, with its ``# via`` annotation (``--annotation-style line``)
PINNED = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)\s*(?:#\s*via\s+(?P<via>.*))?$")


def find_uv() -> str:
    """The ``uv`` executable: beside this interpreter, on ``PATH``, or the ``uv`` package's."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file():
        return str(beside)
    if found := shutil.which("uv"):
        return found
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        raise WheelhouseError(
            "resolving the wheelhouse needs uv (its resolver): `python3 -m pip install uv`, then run this again"
        ) from None


def pip_index_flags() -> list[str]:
    """pip's configured indexes and find-links as uv flags (uv does not read pip's configuration)."""
    script = ROOT / "plugins" / "kits" / "server" / "src" / "core_rl_server_kit" / "pip_as_uv.py"
    proc = subprocess.run([sys.executable, str(script), sys.executable], capture_output=True, text=True, check=False)
    return proc.stdout.split() if proc.returncode == 0 else []


def direct_conflicts(
    ours: dict[str, Path],
    extras: set[str],
    have: dict[str, Version | None],
    env: dict[str, str],
    tools: Sequence[str],
    also: Sequence[str],
) -> list[str]:
    """What the target has at a version that a requirement of core-rl, a selected plugin, the test
    tools or ``--with`` excludes, one line each: named before resolving, as the resolver's own
    explanation of the same conflict is long."""
    wanted: list[tuple[Requirement, str, set[str]]] = []
    for name, wheel in ours.items():
        _, requires = metadata_requirements(wheel)
        wanted += [(Requirement(r), name, extras if name == "core-rl" else set()) for r in requires]
    wanted += [(Requirement(r), "the test suite", set()) for r in tools]
    wanted += [(Requirement(r), "--with", set()) for r in also]
    problems = []
    for req, why, req_extras in wanted:
        name = canonicalize_name(req.name)
        version = have.get(name)
        if name in ours or version is None or not applies(req, env, req_extras):
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"the target has {name} {version}, but {why} requires {req}")
    return problems


def resolve(
    out: Path,
    ours: dict[str, Path],
    extras: set[str],
    have: dict[str, Version | None],
    python_version: str,
    tools: Sequence[str],
    also: Sequence[str],
) -> list[tuple[str, str, str]]:
    """One consistent set of versions for core-rl with ``extras``, its selected plugins (this
    checkout's wheels), ``tools`` and ``also``, for the target's Python and Linux x86-64, holding
    what the target ``have``s at its versions: ``(name, version, what requires it)`` for every
    third-party distribution, ours left out. ``uv pip compile`` resolves it; its result is kept in
    ``out/requirements.txt``."""
    work = out / ".resolve"
    work.mkdir(exist_ok=True)
    core = f"core-rl[{','.join(sorted(extras))}]" if extras else "core-rl"
    inputs = [f"{core} @ {ours['core-rl'].as_uri()}"]
    inputs += [f"{name} @ {wheel.as_uri()}" for name, wheel in sorted(ours.items()) if name != "core-rl"]
    inputs += [*tools, *also]
    (work / "requirements.in").write_text("\n".join(inputs) + "\n")
    pins = [f"{name}=={version}" for name, version in sorted(have.items()) if version is not None and name not in ours]
    (work / "constraints.txt").write_text("\n".join(pins) + "\n")
    command = [
        find_uv(), "pip", "compile", str(work / "requirements.in"),
        "--constraint", str(work / "constraints.txt"),
        "--python-version", python_version, "--python-platform", RESOLVE_PLATFORM,
        "--no-header", "--annotation-style", "line", "--color", "never", "--quiet",
        # pip takes the best version over all its indexes; uv by default only the first index's
        "--index-strategy", "unsafe-best-match",
        *pip_index_flags(),
    ]  # fmt: skip
    # the suite's environment may cap torch for this machine (PIP_CONSTRAINT): not the target's business
    env = {k: v for k, v in os.environ.items() if k not in ("UV_CONSTRAINT", "PIP_CONSTRAINT")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise WheelhouseError(
            f"no set of versions satisfies core-rl's requirements for Python {python_version} on Linux x86-64 with "
            f"what the target has (uv pip compile):\n{proc.stderr.strip()[-4000:]}"
        )
    resolved = []
    for line in proc.stdout.splitlines():
        match = PINNED.match(line.strip())
        if match and canonicalize_name(match["name"]) not in ours:
            resolved.append((canonicalize_name(match["name"]), match["version"], (match["via"] or "").strip()))
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v, _ in resolved))
    return resolved


def build(
    out: Path,
    have: dict[str, Version | None],
    python_version: str,
    extras: set[str],
    include_test_tools: bool,
    also: Sequence[str] = (),
    resolve_only: bool = False,
) -> list[str]:
    """Fill ``out`` with core-rl, the plugins ``extras`` select, the requirements ``also`` names and
    everything they need that ``have`` lacks, at the versions :func:`resolve` picks; return the
    manifest lines (``resolve_only``: the resolved requirements instead, nothing downloaded)."""
    out.mkdir(parents=True, exist_ok=True)
    ours = build_our_wheels(out, selected_projects(extras))
    tools = test_tools() if include_test_tools else []
    problems = direct_conflicts(ours, extras, have, target_environment(python_version), tools, also)
    if problems:
        raise WheelhouseError("the target's packages conflict with core-rl's requirements:\n  " + "\n  ".join(problems))
    resolved = resolve(out, ours, extras, have, python_version, tools, also)
    if resolve_only:
        return [f"{name}=={version}" for name, version, _ in resolved]
    manifest = [f"{ours['core-rl'].name}  (core-rl, built from this checkout)"]
    manifest += [f"{wheel.name}  (core-rl plugin)" for name, wheel in sorted(ours.items()) if name != "core-rl"]
    torch_brings = torch_side(resolved)
    for name, version, via in resolved:
        if name in have or name in torch_brings:
            continue
        path = download(name, SpecifierSet(f"=={version}"), python_version, out)
        manifest.append(f"{path.name}  (required by {via or 'the request'}: {name}=={version})")
    (out / "manifest.txt").write_text("\n".join(manifest) + "\n")
    (out / SOURCES_FILE).write_text(sources_digest.digest(ROOT) + "\n")  # install.sh compares it with its checkout
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the wheelhouse folder (created)")
    parser.add_argument("--have", type=Path, help="the target's `python3 -m pip list --format=freeze`")
    parser.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument("--extras", default="all", help="core-rl extras to include, comma-separated (default all)")
    parser.add_argument("--test-tools", action="store_true", help="also what the test suite needs (pytest, ...)")
    parser.add_argument(
        "--with",
        dest="also",
        action="append",
        default=[],
        metavar="REQ",
        help="another requirement to carry with what it needs, e.g. trl==1.16.0 (repeatable)",
    )
    parser.add_argument(
        "--resolve-only", action="store_true", help="write OUT/requirements.txt (the resolved set) and stop"
    )
    args = parser.parse_args(argv)
    try:
        manifest = build(
            args.out,
            read_have(args.have),
            args.python_version,
            {e.strip() for e in args.extras.split(",") if e.strip()},
            args.test_tools,
            args.also,
            args.resolve_only,
        )
    except WheelhouseError as exc:
        print(f"build_wheelhouse: error: {exc}", file=sys.stderr)
        return 2
    if args.resolve_only:
        print(f"{args.out / 'requirements.txt'}: {len(manifest)} distributions resolved, nothing downloaded")
        return 0
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()) / 2**20
    print(f"{args.out}: {len(manifest)} files, {size:.1f} MiB (see manifest.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
