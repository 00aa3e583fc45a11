"""Shared test settings: one torch thread per process (2-core machines), quiet transformers."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
