"""core-rl's verifiers plugin: verifiers' tasksets and environments as a data source and an
environment named ``verifiers``, run in verifiers' own venv."""
