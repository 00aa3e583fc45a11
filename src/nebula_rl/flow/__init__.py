"""World-model (flow) RL: rectified-flow image and video models, and their samplers with
log-probabilities.

- `dit`: a tiny pixel-space diffusion transformer for CPU tests and demos.
- `diffusers_models`, `vae`: diffusers transformers, in pixel space or in the latent space of
  their pipeline's frozen VAE.
- `sampler`: FlowGRPO's SDE step with its log-probability, the Euler ODE step, classifier-free
  guidance and the trajectory record.
- `clips`, `prompts`: the datasets as files and rows, torch-free (the controller lists a job's
  rows with them); `data`: the clips read into tensors.
- `local`, `job`, `colocated`, `runtime`: the loops (one process, colocated ranks, replicas).

The losses are in `nebula_rl.algorithms.flow`. Importing this package loads nothing else (no
torch): import the module you need.
"""
