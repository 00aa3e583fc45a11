"""nebula-rl: asynchronous, disaggregated RL and SFT post-training for large models."""

__version__ = "0.1.0"
