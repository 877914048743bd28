"""Moving the policy's weights to the rollout engine, and verifying that it serves them."""
