"""Starting a run's processes: local ranks, rendezvous, placement, GPUs, and bounded waits on other
ranks."""

from core_rl.plugins.lazy_exports import lazy_exports

# what plugins import from this package: its public names (core_rl.testing.public_api)
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.launch.gpus": (
            "gpus_per_server",
            "servers_gpus",
            "visible_devices",
        ),
        "core_rl.launch.launchers": (
            "LaunchRequest",
            "Launcher",
            "launcher_check",
        ),
        "core_rl.launch.placement": (
            "ClusterResources",
            "placement_mode",
            "placement_problems",
            "server_options",
        ),
        "core_rl.launch.ranks": (
            "collective_timeout",
            "is_loopback",
            "rank_and_world",
            "waiting_for",
        ),
        "core_rl.launch.rendezvous": ("Rendezvous",),
    },
)
