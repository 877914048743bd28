"""Registries and the plugin host: registration, duplicates, unknown names, lazy entry points,
import failures, allow and block lists."""

from __future__ import annotations

import importlib.metadata as md
import sys
import textwrap
from pathlib import Path

import pytest
from core_rl.errors import PluginError
from core_rl.hookspecs import hookimpl
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LOGGER, REWARD, ROLLOUT_ENGINE, TRAIN_ENGINE


class _TwoRewards:
    @hookimpl
    def core_rl_register_rewards(self, register):
        register("a", lambda c: None, description="first line\nsecond line")
        register("b", lambda c: None, description="b")


def test_entries_record_provider_and_first_description_line():
    host = PluginHost(entry_points=[])
    host.register_plugin(_TwoRewards(), distribution="dist-x", version="1.2")
    entry = host.get(REWARD, "a")
    assert (entry.name, entry.distribution, entry.version, entry.description) == ("a", "dist-x", "1.2", "first line")
    assert host.registries["reward"].names() == ["a", "b"]


def test_duplicate_name_is_an_error_naming_both_distributions():
    host = PluginHost(entry_points=[])
    host.register_plugin(_TwoRewards(), distribution="dist-x")

    class Again:
        @hookimpl
        def core_rl_register_rewards(self, register):
            register("a", lambda c: None, description="again")

    with pytest.raises(PluginError, match=r"'a' is registered twice: by dist-x and by dist-y"):
        host.register_plugin(Again(), distribution="dist-y")


def test_override_replaces_on_purpose():
    host = PluginHost(entry_points=[])
    host.register_plugin(_TwoRewards(), distribution="dist-x")

    class Override:
        @hookimpl
        def core_rl_register_rewards(self, register):
            register("a", lambda c: "new", description="replacement", override=True)

    host.register_plugin(Override(), distribution="dist-y")
    assert host.get(REWARD, "a").distribution == "dist-y"

    class SecondOverride:
        @hookimpl
        def core_rl_register_rewards(self, register):
            register("a", lambda c: None, description="another", override=True)

    with pytest.raises(PluginError, match="registered twice: by dist-y and by dist-z"):
        host.register_plugin(SecondOverride(), distribution="dist-z")


def test_config_cls_must_be_attrs():
    class Bad:
        @hookimpl
        def core_rl_register_loggers(self, register):
            register("bad", lambda c: None, description="x", config_cls=dict)

    with pytest.raises(PluginError, match="not an attrs class"):
        PluginHost(entry_points=[]).register_plugin(Bad(), distribution="d")


def test_unknown_name_lists_installed_and_extra():
    host = PluginHost(entry_points=[])

    class Engines:
        @hookimpl
        def core_rl_register_rollout_engines(self, register):
            register("hf", lambda *a, **k: None, description="x")

    host.register_plugin(Engines(), distribution="d")
    with pytest.raises(PluginError) as info:
        host.get(ROLLOUT_ENGINE, "sglang")
    msg = str(info.value)
    assert "rollout engine 'sglang' is not installed (installed: hf)" in msg
    with pytest.raises(PluginError, match=r'pip install "core-rl\[fsdp\]"'):
        host.get(TRAIN_ENGINE, "fsdp")
    with pytest.raises(PluginError, match="no core-rl extra provides it"):
        host.get(TRAIN_ENGINE, "my-own-engine")


@pytest.fixture
def plugin_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three importable plugin modules: a good one, one that fails to import, one never selected."""
    (tmp_path / "crl_good_plugin.py").write_text(
        textwrap.dedent("""
        from core_rl.hookspecs import hookimpl
        from core_rl.interfaces import Reward

        class Built(Reward):
            def score(self, items):
                return [1.0 for _ in items]

        @hookimpl
        def core_rl_register_rewards(register):
            register("good", lambda c: Built(), description="a good reward")
    """)
    )
    (tmp_path / "crl_broken_plugin.py").write_text("raise ImportError('missing dependency frobnicate')\n")
    (tmp_path / "crl_unused_plugin.py").write_text(
        textwrap.dedent("""
        from core_rl.hookspecs import hookimpl

        @hookimpl
        def core_rl_register_rewards(register):
            register("unused", lambda c: None, description="never selected")
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("crl_good_plugin", "crl_broken_plugin", "crl_unused_plugin"):
        sys.modules.pop(name, None)
    return tmp_path


def _eps() -> list[md.EntryPoint]:
    return [
        md.EntryPoint("good", "crl_good_plugin", "core_rl.rewards"),
        md.EntryPoint("broken", "crl_broken_plugin", "core_rl.rewards"),
        md.EntryPoint("unused", "crl_unused_plugin", "core_rl.rewards"),
    ]


def test_only_selected_entry_points_are_imported(plugin_modules):
    host = PluginHost(entry_points=_eps(), environ={})
    assert type(host.create(REWARD, "good", None)).__name__ == "Built"
    assert "crl_good_plugin" in sys.modules
    assert "crl_unused_plugin" not in sys.modules
    assert "crl_broken_plugin" not in sys.modules


def test_import_failure_is_reported_and_does_not_stop_others(plugin_modules):
    host = PluginHost(entry_points=_eps(), environ={})
    statuses = {s.name: s for s in host.load_all()}
    assert statuses["broken"].status == "failed"
    assert "missing dependency frobnicate" in statuses["broken"].error
    assert statuses["good"].status == "loaded" and statuses["unused"].status == "loaded"
    with pytest.raises(PluginError, match="reward 'broken' .* failed to load: ImportError: missing dependency"):
        host.get(REWARD, "broken")


def test_block_and_allow_lists(plugin_modules):
    # constructed entry points have no distribution, so they report as "<unknown>"
    blocked = PluginHost(entry_points=_eps(), environ={"CORE_RL_PLUGINS_BLOCK": "<unknown>"})
    with pytest.raises(PluginError, match="blocked by CORE_RL_PLUGINS_BLOCK"):
        blocked.get(REWARD, "good")
    assert {s.status for s in blocked.load_all()} == {"blocked"}
    assert "good" not in blocked.available_names(REWARD)
    allowed_other = PluginHost(entry_points=_eps(), environ={"CORE_RL_PLUGINS_ALLOW": "some-other-dist"})
    with pytest.raises(PluginError, match="blocked"):
        allowed_other.get(REWARD, "good")
    allowed = PluginHost(entry_points=_eps(), environ={"CORE_RL_PLUGINS_ALLOW": "<unknown>"})
    assert type(allowed.create(REWARD, "good", None)).__name__ == "Built"


def test_builtin_loggers_come_through_entry_points():
    host = PluginHost(environ={})
    for name in ("console", "jsonl"):
        entry = host.get(LOGGER, name)
        assert entry.distribution == "core-rl"
    assert PluginHost(environ={"CORE_RL_PLUGINS_ALLOW": "nothing-else"}).get(LOGGER, "jsonl")


@pytest.fixture
def override_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "crl_plain_logger.py").write_text(
        textwrap.dedent("""
        from core_rl.hookspecs import hookimpl
        from core_rl.interfaces import Logger

        class Tagged(Logger):
            def __init__(self, tag):
                self.tag = tag

            def log(self, metrics, step):
                pass

        @hookimpl
        def core_rl_register_loggers(register):
            register("shared", lambda c: Tagged("plain"), description="the original")
    """)
    )
    (tmp_path / "crl_override_logger.py").write_text(
        textwrap.dedent("""
        from core_rl.hookspecs import hookimpl
        from core_rl.interfaces import Logger

        class Tagged(Logger):
            def __init__(self, tag):
                self.tag = tag

            def log(self, metrics, step):
                pass

        @hookimpl
        def core_rl_register_loggers(register):
            register("shared", lambda c: Tagged("override"), description="the replacement", override=True)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("crl_plain_logger", "crl_override_logger"):
        sys.modules.pop(name, None)
    return tmp_path


@pytest.mark.parametrize(
    "order", [("crl_plain_logger", "crl_override_logger"), ("crl_override_logger", "crl_plain_logger")]
)
def test_override_wins_whatever_the_load_order(override_modules, order):
    eps = [md.EntryPoint("shared", module, "core_rl.loggers") for module in order]
    host = PluginHost(entry_points=eps, environ={})
    assert host.create(LOGGER, "shared", None).tag == "override"
    assert [s.status for s in host.statuses()] == ["loaded", "loaded"]


def test_env_lists_compare_names_as_packaging_does():
    from core_rl.plugins.host import _normalise, _split_env

    assert _split_env(" Core_RL.Example-plugin , other ") == {"core-rl-example-plugin", "other"}
    assert _normalise("core_rl__grpo") == "core-rl-grpo"


class _CountingDistribution(md.PathDistribution):
    """A real installed-distribution record (a ``dist-info`` directory) that counts how often its
    metadata file is parsed."""

    parses = 0

    @property
    def metadata(self):  # type: ignore[override]
        self.parses += 1
        return super().metadata


def test_a_distribution_metadata_is_parsed_once_per_host(plugin_modules, tmp_path):
    """Each parse reads the whole metadata file (core-rl's holds its README), and the host asks for
    a distribution's name and version of each of its entry points several times (deduplication,
    ordering, loading, listing): one parse per distribution serves them all."""
    info = tmp_path / "dist_q-2.0.dist-info"
    info.mkdir()
    headers = "Metadata-Version: 2.1\nName: dist-q\nVersion: 2.0\n\n"
    (info / "METADATA").write_text(headers + "A long description.\n" * 500)
    groups = "[core_rl.rewards]\ngood = crl_good_plugin\nbroken = crl_broken_plugin\nunused = crl_unused_plugin\n"
    (info / "entry_points.txt").write_text(groups)
    dist = _CountingDistribution(info)
    host = PluginHost(entry_points=list(dist.entry_points), environ={})
    statuses = host.load_all() + host.statuses()
    assert {(s.name, s.distribution, s.version) for s in statuses} == {
        (name, "dist-q", "2.0") for name in ("good", "broken", "unused")
    }
    assert dist.parses == 1
