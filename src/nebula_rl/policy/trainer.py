"""The policy's training step: the RL and SFT updates.

One `PolicyTrainer` owns a model, its optimiser and LR schedule (`policy/optim.py`), and with
`train.ema_enable` the averages of its weights (`policy/ema.py`). `grpo_step`
takes scored rollout groups and performs `mu_iterations` passes over them, one optimiser update
per slice of `batch_size_per_optimize` sequences per pass (one slice when unset); `sft_step` takes
tokenised conversations and performs one update. Both accumulate gradients over micro-batches
(`mini_batch` sequences, or `max_token_len_per_mini_batch` tokens) with the global token and
sequence counts of the update as loss denominators (STYLE rule 3), so the result does not depend
on how the batch is split. With a :class:`ReplicaGroup` the step spans several policy replicas:
counts and gradients are summed over them before the update, every replica takes the same number
of updates, and the returned metrics describe the union of their batches. With
`train.sequence_packing`, `sft_step` packs its conversations into rows of up to
`policy.model_max_length` tokens with a block-diagonal causal mask
(:mod:`nebula_rl.data.packing`); the loss is the same as unpacked.

Precision: the model holds `train.master_dtype` weights (its callers load it so, see
`policy/setup.py`); forward and backward run under autocast to `train.param_dtype` unless FSDP2
casts the parameters itself; logits are cast to `train.logprob_dtype` before the log-softmax,
which runs a chunk of target positions at a time (`policy/logprobs.py`).

The PPO ratio is taken against the proximal ("old") policy: the rollout's own log-probs with
`use_rollout_logprobs_for_loss` (1 for on-policy samples, a clipped correction for stale ones),
otherwise log-probs the policy recomputes at the start of the step. Decoupled PPO and AIPO always
recompute them, and weigh tokens by the rollout's (behaviour) log-probs; without
`collect_rollout_logprobs` the rollouts send none and nothing reads them.

The class is assembled from modules of this package: `trainer_base` (the state, sums over ranks
and replicas, the optimiser update), `rl_step` (`grpo_step`), `sft_step` (`sft_step`,
`sft_eval`), `forward` (the labels, a batch's forward) and `loss_settings`.
"""

from __future__ import annotations

from nebula_rl.policy.batching import TokenBatch, collate_groups, pack_examples
from nebula_rl.policy.logprobs import token_logprobs
from nebula_rl.policy.loss_settings import loss_settings
from nebula_rl.policy.optim import lr_lambda
from nebula_rl.policy.rl_step import _RLStep
from nebula_rl.policy.sft_step import SftExample, _SftStep

__all__ = [
    "PolicyTrainer",
    "SftExample",
    "TokenBatch",
    "collate_groups",
    "loss_settings",
    "lr_lambda",
    "pack_examples",
    "token_logprobs",
]


class PolicyTrainer(_RLStep, _SftStep):
    """Model + optimiser + schedule, and the two kinds of update.

    `model` is an HF causal LM trained whole in this process, or a :class:`ParallelModel`
    (`policy/setup.py`'s `parallelize_policy`), split over this process group: then every rank
    calls `grpo_step` with the same groups and `sft_step` with its own data-parallel share, and
    `ref_model` is split the same way (`parallelize_reference`).
    """
