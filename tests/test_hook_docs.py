"""Every hook spec is documented: in its docstring (each parameter and the return value) and in the
plugin-author guide, docs/plugin-guide.md, whose kinds table must pair each hook with its group."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from core_rl import hookspecs
from core_rl.plugins.kinds import ALL_KINDS, PluginKind

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugin-guide.md"
SPEC_ATTRIBUTE = f"{hookspecs.PROJECT_NAME}_spec"  # what pluggy's HookspecMarker sets on a spec


def hook_functions() -> dict[str, Callable[..., Any]]:
    """Every function of core_rl.hookspecs named ``core_rl_*``."""
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith(f"{hookspecs.PROJECT_NAME}_")
    }


HOOKS = sorted(hook_functions())


def guide_text() -> str:
    assert GUIDE.is_file(), f"{GUIDE} is missing"
    return GUIDE.read_text(encoding="utf-8")


def test_hooks_are_found() -> None:
    assert len(HOOKS) >= len(ALL_KINDS), HOOKS


def test_every_core_rl_function_is_a_hook_spec_and_every_spec_is_named_so() -> None:
    specs = {
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(fn, SPEC_ATTRIBUTE, None) is not None
    }
    assert specs == set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_docstring_documents_every_parameter_and_the_return(name: str) -> None:
    fn = hook_functions()[name]
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name} has no docstring"
    for param in inspect.signature(fn).parameters:
        assert re.search(rf":param {re.escape(param)}:\s*\S", doc), f"{name}: no ':param {param}:' description"
    assert re.search(r":returns?:\s*\S", doc), f"{name}: no ':return:' description"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_in_the_plugin_guide(name: str) -> None:
    assert f"`{name}`" in guide_text(), f"docs/plugin-guide.md does not mention the hook `{name}`"


@pytest.mark.parametrize("kind", ALL_KINDS, ids=lambda kind: kind.key)
def test_guide_table_pairs_each_kind_with_its_hook_and_group(kind: PluginKind) -> None:
    assert kind.hook in hook_functions(), f"kind {kind.key} names hook {kind.hook}, which is not a spec"
    rows = [line for line in guide_text().splitlines() if line.startswith("|") and f"`{kind.hook}`" in line]
    assert rows, f"no table row of docs/plugin-guide.md names `{kind.hook}`"
    assert any(f"`{kind.group}`" in row and row.startswith(f"| {kind.label} |") for row in rows), (
        f"the guide's row for `{kind.hook}` must start with the kind '{kind.label}' and name the group `{kind.group}`"
    )
