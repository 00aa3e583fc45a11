"""nebula_rl.policy."""
