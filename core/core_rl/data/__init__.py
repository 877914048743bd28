"""Training data: data files, prompt rows and mixtures."""
