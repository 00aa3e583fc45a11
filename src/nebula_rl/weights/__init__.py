"""nebula_rl.weights."""
