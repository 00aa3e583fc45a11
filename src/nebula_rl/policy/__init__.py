"""Policy replicas: the trainer of the GRPO-family and SFT steps, its worker loop, the training
loop of runs inside one job, data parallelism across replicas, checkpoints, the distillation
teacher."""
