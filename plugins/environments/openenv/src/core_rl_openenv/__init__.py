"""core-rl's OpenEnv plugin: an OpenEnv environment server (started locally or given by URL) as
the environment ``openenv``, talked to with OpenEnv's own client in OpenEnv's own venv."""
