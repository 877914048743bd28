"""The documentation site: ``mkdocs build --strict`` passes (no broken link, no page left out of the
navigation), and its configuration reference, generated from the configuration classes, lists every
key a resolved configuration has, with what the loader accepts for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.config.reference import field_comments, reference_markdown, requirement, sections
from core_rl.config.schema import RewardRunnerConfig, RunConfig
from core_rl.config.validators import auto_or, each, in_range, one_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_grpo" / "ppo.yaml"


def _leaves(tree: object, path: str = "") -> list[str]:
    if isinstance(tree, dict):
        out = [path] if path else []
        for key, value in tree.items():
            out += _leaves(value, f"{path}.{key}" if path else str(key))
        return out
    return [path]


@pytest.fixture(scope="module")
def reference() -> str:
    return reference_markdown()


def test_every_key_of_a_resolved_config_is_in_the_reference(reference: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "core_rl.cli", "config", "show", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    keys = _leaves(yaml.safe_load(shown.stdout))
    assert len(keys) > 150
    # sections selected by name (actor.engine, critic.engine, rollout.workflow, ...): their `name` is
    # the section's own row, their other keys belong to the selected plugin's config class
    plugin_sections = {row.path for s in sections(RunConfig) for row in s.rows if "PluginSpec" in row.type}
    assert {"actor.engine", "rollout.engine", "critic.engine", "trainer.loop", "reward"} <= plugin_sections
    missing = []
    for key in keys:
        section = next((s for s in plugin_sections if key.startswith(s + ".")), None)
        if section is not None:
            own = key[len(section) + 1 :]
            if own != "name" and f"| `{own}` |" not in reference:
                missing.append(key)
        elif f"| `{key}` |" not in reference:
            missing.append(key)
    assert not missing, missing


def test_each_key_says_what_it_accepts_and_its_default(reference: str) -> None:
    assert "| `reward_runner.on_error` | str | `'value'` | must be one of 'value', 'drop', 'stop' |" in reference
    assert "| `experiment.seed` | int | `1` | must be in [0, 4294967295] |" in reference
    # a field's "#:" comment and a section's docstring come along
    assert "evaluation on held-out prompts while training" in reference
    assert RewardRunnerConfig.__doc__.split("\n")[0].replace("``", "`").split(":mod:")[0] in reference
    # the installed plugins' own keys, under their distribution
    assert "#### `fsdp` (core-rl-fsdp)" in reference and "| `reshard_after_forward` | bool | `true` |" in reference


def test_validators_describe_themselves() -> None:
    assert requirement(in_range(0.0, 1.0, low_open=True)) == "must be in (0.0, 1.0]"
    assert requirement(one_of(("a", "b"))) == "must be one of 'a', 'b'"
    assert requirement(auto_or(in_range(1, 8))) == "'auto', or in [1, 8]"
    assert requirement(each(in_range(0, 1))) == "each item in [0, 1]"
    import attrs

    assert requirement(attrs.validators.optional(in_range(0, 1))) == "must be in [0, 1], or null"
    assert requirement(attrs.validators.and_(in_range(0, 1), one_of(("x",)))) == (
        "must be in [0, 1]; must be one of 'x'"
    )


def test_sections_walk_every_nested_section_once_in_field_order() -> None:
    walked = [s.path for s in sections(RunConfig)]
    assert walked[0] == "" and len(walked) == len(set(walked))
    assert walked.index("actor") < walked.index("actor.optimizer") < walked.index("rollout")
    top = {row.path for row in next(iter(sections(RunConfig))).rows}
    import attrs

    assert top == {f.name for f in attrs.fields(RunConfig) if f.init}
    assert field_comments(RunConfig)["eval"].startswith("evaluation on held-out prompts")


def test_the_site_builds_strictly_with_the_reference(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    page = (site / "reference" / "configuration" / "index.html").read_text()
    assert "reward_runner.on_error" in page and "core-rl-fsdp" in page
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index")
    assert {"install", "quickstart", "runs", "configuration", "data", "rewards", "algorithms", "engines"} <= set(pages)
    assert {"servers", "scaling", "async", "agents", "reliability", "when-stuck", "architecture"} <= set(pages)
    assert {"plugin-guide", "benchmarks", "real-models", "memory"} <= set(pages)
    for name in pages:
        assert (site / name / "index.html").is_file(), name
    # every page is in the navigation (mkdocs only says so at INFO level)
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    assert [name for name in pages if f" {name}.md" not in nav] == []
