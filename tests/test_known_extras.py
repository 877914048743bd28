"""``core_rl.plugins.kinds.KNOWN_EXTRAS`` (the install hint of an unknown plugin name) against the in-repo plugins'
``pyproject.toml`` files and core-rl's extras: every entry point a plugin declares is listed with the
extra that installs its distribution, and nothing else is listed. (A name missing from it told a user
"no core-rl extra provides it" for a plugin that one does provide.)"""

from __future__ import annotations

import packaging_utils as pu
from core_rl.plugins.kinds import ALL_KINDS, COMMANDS_GROUP, KNOWN_EXTRAS
from packaging.requirements import Requirement


def _declared() -> dict[tuple[str, str], str]:
    """(kind key, name) -> the core-rl extra whose requirement installs the plugin declaring it."""
    optional = pu.read_pyproject(pu.REPO_ROOT)["project"]["optional-dependencies"]
    extra_of = {
        pu.normalise(Requirement(requirement).name): extra
        for extra, requirements in optional.items()
        if extra != "all"
        for requirement in requirements
    }
    key_of = {kind.group: kind.key for kind in ALL_KINDS}
    declared = {}
    for project in pu.plugin_project_dirs():
        for group, name in pu.declared_entry_points(project):
            if group == COMMANDS_GROUP:  # a command (the server kit's server-env), not a name a config selects
                continue
            assert group in key_of, f"{project}: entry-point group {group} is no plugin kind"
            declared[(key_of[group], name)] = extra_of[pu.distribution_name(project)]
    return declared


def test_every_in_repo_entry_point_has_its_extra_and_nothing_else_is_listed() -> None:
    declared = _declared()
    assert len(declared) > 50
    assert KNOWN_EXTRAS == declared


def test_a_name_whose_plugin_is_absent_gets_the_extra_that_provides_it() -> None:
    """The message as a user reads it where the plugin is not installed (the registry lacks the name)."""
    from core_rl.plugins.host import unknown_name_message
    from core_rl.plugins.kinds import LAUNCHER, WORKFLOW

    message = unknown_name_message(WORKFLOW, "openai_agent", ["environment", "single_turn"])
    assert message.endswith('install it with: pip install "core-rl[openai-proxy]"'), message
    assert unknown_name_message(LAUNCHER, "ray", ["slurm"]).endswith('pip install "core-rl[ray]"')
