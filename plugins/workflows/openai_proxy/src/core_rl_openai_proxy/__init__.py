"""core-rl rollout workflow ``openai_agent``: an agent program (plain OpenAI client code) talks to an
OpenAI-compatible proxy in front of the rollout engine; each session's calls become one token-exact
trajectory (see the package README)."""
