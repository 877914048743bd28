"""pip's configured package locations as uv flags (standard library only).

uv does not read pip's configuration, so where pip finds a package (an extra index, a directory of
local wheels such as this machine's CPU build of torch), uv would not. :func:`pip_settings_as_uv_flags`
reads ``pip config list`` (configuration files and ``PIP_*`` variables) and returns the matching uv
flags. The server environments (:mod:`core_rl_server_kit.env`) install with them, and
``scripts/install.sh`` runs this file before core-rl is installed:
``python plugins/kits/server/src/core_rl_server_kit/pip_as_uv.py PYTHON`` prints one flag or value per line.
"""

from __future__ import annotations

import subprocess
import sys

#: pip configuration keys passed on to uv, with uv's flag for each value
PIP_SETTINGS_FOR_UV = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def pip_settings_as_uv_flags(python: str) -> list[str]:
    """pip's configured indexes and find-links for the interpreter ``python`` as uv flags; a
    ``PIP_*`` variable beats every file, and later files beat earlier ones, as in pip."""
    out = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=120, check=False
    )
    from_files: dict[str, list[str]] = {}
    from_env: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, sep, raw = line.partition("=")
        setting = key.rsplit(".", 1)[-1]
        if sep and setting in PIP_SETTINGS_FOR_UV:
            # one line per source, files in increasing precedence
            (from_env if key.startswith(":env:") else from_files)[setting] = raw.strip().strip("'\"").split()
    flags = []
    for setting, items in {**from_files, **from_env}.items():
        for item in items:
            flags += [PIP_SETTINGS_FOR_UV[setting], item]
    return flags


if __name__ == "__main__":
    print("\n".join(pip_settings_as_uv_flags(sys.argv[1] if len(sys.argv) > 1 else sys.executable)))
