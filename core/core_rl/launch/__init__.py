"""Starting a run's processes: local ranks, rendezvous, placement, GPUs, and bounded waits on other
ranks."""
