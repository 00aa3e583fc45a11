"""nebula_rl.controller."""
