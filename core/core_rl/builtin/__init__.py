"""Components that ship with core-rl itself; they register through the same hooks and entry points
as any third-party plugin (see the ``core_rl.loggers`` entry points in the root pyproject.toml)."""
