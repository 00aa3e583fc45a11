"""Policy replicas: the trainer of the GRPO-family and SFT steps, its worker loop, data parallelism
across replicas, checkpoints."""
