"""The README is a front page: at most 320 lines, its two commands the ones CI and the install use,
its one YAML example a valid configuration, and every relative link in it and in the documentation
pages (``docs/*.md``) names a file that exists. The README's former content lives in ``docs/``;
the tests that read it read the page that now holds it (``tests/test_readme_usage.py``: docs/runs.md;
``tests/test_quickstart.py``: docs/quickstart.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: pages the site's hooks generate (docs/hooks/generated_pages.py): linked to, never on disk
GENERATED = {DOCS / "reference" / "configuration.md"}
LINK = re.compile(r"(?<!`)\[[^\]]*\]\(([^)\s]+)\)")


def _fenced_out(text: str) -> str:
    """The text without its fenced code blocks (a ``[x](y)`` there is code, not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _relative_links(page: Path) -> list[str]:
    targets = LINK.findall(_fenced_out(page.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_readme_stays_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines; move the detail into a page under docs/"


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_relative_link_names_an_existing_file(page: Path) -> None:
    missing = []
    for target in _relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not (path.exists() or path in GENERATED):
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def _heading_ids(page: Path) -> set[str]:
    """The ids the site gives the page's headings (python-markdown's ``toc`` slugs)."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", _fenced_out(page.read_text()), flags=re.M):
        text = re.sub(r"[`*]", "", heading)
        ids.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower()))
    return ids


def test_the_readme_links_into_the_docs_name_existing_headings() -> None:
    """Links between the docs pages are checked by the strict site build (``validation.anchors``);
    the README is not part of the site, so its links into the pages are checked here."""
    missing = []
    for target in _relative_links(README):
        path, _, anchor = target.partition("#")
        if anchor and path.startswith("docs/") and anchor not in _heading_ids(ROOT / path):
            missing.append(target)
    assert not missing, f"README.md links to headings that do not exist: {missing}"


def test_the_links_are_found() -> None:
    """The link pattern sees the README's links into the docs (a pattern that found none would pass
    the test above vacuously)."""
    links = _relative_links(README)
    assert "docs/quickstart.md" in links and "docs/install.md#running-the-tests" in links
    assert len(_relative_links(DOCS / "index.md")) >= 15


def test_the_readme_commands_are_the_install_and_ci_ones() -> None:
    text = README.read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks[0].strip() == "bash scripts/install.sh && .venv/bin/python examples/tiny_grpo/main.py"
    assert blocks[1].strip() == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text().splitlines()
    assert (ROOT / "examples" / "tiny_grpo" / "main.py").is_file()


def test_the_readme_yaml_example_is_a_valid_configuration(tmp_path: Path) -> None:
    from core_rl.config import load_config
    from core_rl.plugins.host import PluginHost

    [block] = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    config = tmp_path / "run.yaml"
    config.write_text(block)
    # the overrides of the README's own `core-rl train` line
    cfg = load_config(config, ["trainer.total_steps=20"], host=PluginHost(), notify=lambda _: None)
    assert cfg.algorithm.name == "grpo" and cfg.trainer.total_steps == 20
    assert "core-rl train run.yaml trainer.total_steps=20" in README.read_text()
