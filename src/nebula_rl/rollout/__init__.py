"""nebula_rl.rollout."""
