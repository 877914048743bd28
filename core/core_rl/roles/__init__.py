"""The models of a run: building each role's engine, model-directory checks and overrides, GGUF and
tiny models."""
