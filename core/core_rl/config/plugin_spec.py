"""Plugin sections of a run configuration: :class:`PluginSpec` (``{name: ..., ...options}``), and
the field helpers a plugin's config class uses: :func:`default_from` (a field whose default is
another key of the run) and :func:`plugin_section` (a field holding another plugin's section).
Re-exported by :mod:`core_rl.config.schema`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from core_rl.errors import PluginError
from core_rl.plugins.registry import RegistryEntry

if TYPE_CHECKING:
    from core_rl.plugins.kinds import PluginKind

#: attrs field metadata key, see :func:`default_from`
DEFAULT_FROM = "core_rl_default_from"


def default_from(path: str) -> dict[str, str]:
    """Metadata for a plugin config field whose default is another key of the run configuration:
    ``attrs.field(default=None, metadata=default_from("rollout.sampling.max_new_tokens"))``. When the
    plugin's section leaves the field unset, the loader fills it with the value at the dotted
    ``path`` (so ``core-rl config show`` prints what the component will use)."""
    return {DEFAULT_FROM: path}


#: attrs field metadata key marking a field of a plugin's config class as a nested plugin section
PLUGIN_KIND_METADATA = "core_rl.plugin_kind"


@attrs.define
class PluginSpec:
    """``{name: <registered name>, ...options}``. ``config`` is the options validated by the
    plugin's ``config_cls`` (filled in by the loader; ``None`` if the plugin takes no options) and
    ``entry`` the registry entry the loader resolved ``name`` to."""

    name: str
    options: dict[str, Any] = attrs.field(factory=dict)
    config: Any = attrs.field(default=None, eq=False)
    entry: RegistryEntry | None = attrs.field(default=None, eq=False, repr=False)

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Build the component: ``entry.factory(*args, config, **kwargs)`` (for rewards, loggers,
        losses, advantages and filters simply ``spec.build()``), checked as
        :func:`core_rl.plugins.components.build_component` says. Only for a spec the loader has validated,
        e.g. a nested section declared with :func:`plugin_section`."""
        if self.entry is None:
            raise PluginError(
                f"plugin section {self.name!r} was not validated by the configuration loader "
                "(core_rl.config.loader.validate_plugin_section), so it cannot be built"
            )
        from core_rl.plugins.components import build_component

        return build_component(self.entry, *args, self.config, **kwargs)


def plugin_section(kind: PluginKind, **field_kwargs: Any) -> Any:
    """An attrs field of a plugin's config class holding another plugin's section (a
    :class:`PluginSpec`, ``PluginSpec | None``, ``list[PluginSpec]`` or ``dict[str, PluginSpec]``, whose
    sections' key paths end in the index or the key: ``reward.routes.gsm8k``) of ``kind``.

    The loader validates such a section by the selected plugin's own config class, with the full
    key path (``reward.parts[1].reward.pattern: ...``), at any depth, and resolves its registry
    entry, so the outer component's factory builds it with :meth:`PluginSpec.build`::

        @attrs.define
        class Part:
            weight: float = 1.0
            reward: PluginSpec = plugin_section(REWARD)
    """
    metadata = {**field_kwargs.pop("metadata", {}), PLUGIN_KIND_METADATA: kind}
    return attrs.field(metadata=metadata, **field_kwargs)
