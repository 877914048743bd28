"""core-rl plot: training curves of runs (the `core-rl plot` command, `core_rl_plot.plot.plot_runs`)."""
