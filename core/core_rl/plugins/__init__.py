"""The plugin host: discovery through entry points, the registries, the kinds, building components and
holding them to their contracts."""
