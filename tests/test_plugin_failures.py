"""``core-rl plugins`` and unknown-name messages show plugins that fail to load as failed, with their
whole reason: a module that raises on import, and an entry point whose plugin registers another name
(``mismatch-name`` vs ``mismatch_name``). The distribution ``core-rl-demo`` is installed for real
into a directory of its own (a ``.dist-info`` with its entry points, next to its modules) that the
commands find on ``PYTHONPATH``, as after ``pip install``."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import packaging_utils as pu
import pytest
from core_rl.errors import PluginError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import REWARD

IMPORT_ERROR = (
    'crl_demo_frobnicator needs frobnicate >= 2.0: install it with pip install "core-rl-demo[gpu]" and then check '
    "that CUDA 12.4 or newer is on the library path of this machine"
)

MODULES = {
    "crl_demo_mismatch": """
        from core_rl.hookspecs import hookimpl

        @hookimpl
        def core_rl_register_rewards(register):
            register("mismatch_name", lambda config: None, description="registers another name")
    """,
    "crl_demo_frobnicator": f"raise ImportError({IMPORT_ERROR!r})\n",
    "crl_demo_typo": "def score(items:\n    return []\n",
    "crl_demo_keyword": """
        from core_rl.hookspecs import hookimpl

        @hookimpl
        def core_rl_register_rewards(register):
            register("keyword_score", lambda config: None, description="scores [0, 1] by [rules]")
    """,
}
ENTRY_POINTS = """
[core_rl.rewards]
mismatch-name = crl_demo_mismatch
frobnicator = crl_demo_frobnicator
keyword_score = crl_demo_keyword
typo_reward = crl_demo_typo
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding the installed distribution core-rl-demo 0.3.0, importable from here."""
    root = pu.install_modules(tmp_path / "site", "core-rl-demo", "0.3.0", MODULES, ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(root))
    return root


def demo_host(site: Path) -> PluginHost:
    """A host whose only plugins are core-rl-demo's entry points."""
    (dist,) = md.distributions(path=[str(site)])
    return PluginHost(entry_points=list(dist.entry_points), environ={})


def cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return pu.cli(sys.executable, *args, pythonpath=[site])


def test_an_entry_point_whose_plugin_registers_another_name_fails(site: Path) -> None:
    host = demo_host(site)
    statuses = {s.name: s for s in host.load_all()}
    assert statuses["mismatch-name"].status == "failed"
    assert "registered 'mismatch_name'" in statuses["mismatch-name"].error
    assert "not 'mismatch-name'" in statuses["mismatch-name"].error
    # the name it registered instead cannot be selected either: nothing would load it in a run
    assert statuses["mismatch_name"].status == "failed"
    assert "no entry point in group core_rl.rewards is named 'mismatch_name'" in statuses["mismatch_name"].error
    with pytest.raises(PluginError, match=r"reward 'mismatch-name' from core-rl-demo 0.3.0 failed to load: its"):
        demo_host(site).get(REWARD, "mismatch-name")


def test_an_import_failure_keeps_its_whole_message(site: Path) -> None:
    statuses = {s.name: s for s in demo_host(site).load_all()}
    assert (statuses["frobnicator"].status, statuses["frobnicator"].error) == ("failed", f"ImportError: {IMPORT_ERROR}")
    # a syntax error says where it is, not only "SyntaxError: ..."
    typo = statuses["typo_reward"]
    assert typo.status == "failed"
    assert f'File "{site / "crl_demo_typo.py"}", line 1' in typo.error and "SyntaxError" in typo.error


def test_did_you_mean_offers_only_plugins_that_load(site: Path) -> None:
    with pytest.raises(PluginError) as info:
        demo_host(site).get(REWARD, "frobnicatr")
    message = str(info.value)
    assert "did you mean" not in message
    assert message.startswith(
        "reward 'frobnicatr' is not installed (installed: keyword_score); 'frobnicator' fails to load: ImportError: "
    )
    assert IMPORT_ERROR in message
    with pytest.raises(PluginError, match=r"did you mean 'keyword_score'\? \(installed: keyword_score\)"):
        demo_host(site).get(REWARD, "keyword_scor")


def test_the_plugins_command_shows_failures_with_their_whole_reason(site: Path) -> None:
    proc = cli(site, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["frobnicator"]["status"] == f"failed: ImportError: {IMPORT_ERROR}"
    assert rows["mismatch-name"]["status"].startswith("failed: its plugin crl_demo_mismatch registered 'mismatch_name'")
    assert rows["mismatch_name"]["status"].startswith("failed: registered by crl_demo_mismatch")
    assert rows["keyword_score"]["status"] == "loaded"
    table = cli(site, "plugins")
    assert table.returncode == 0, table.stderr
    # square brackets are text, not console markup to drop
    shown = {row[1]: row for row in table_rows(table.stdout)}
    assert shown["frobnicator"][6] == f"failed: ImportError: {IMPORT_ERROR}"  # after the claims column
    assert shown["mismatch-name"][6] == rows["mismatch-name"]["status"]
    assert shown["keyword_score"][4] == "scores [0, 1] by [rules]"
    assert shown["tis"][4] == "Truncated importance sampling: clamp pi_prox/pi_behave to [lower, upper]"


def table_rows(text: str) -> list[list[str]]:
    """The cells of the body rows of a ``core-rl plugins`` table; a cell wrapped over several
    lines is joined back with single spaces."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows
