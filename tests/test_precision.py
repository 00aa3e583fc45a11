"""Mixed precision: weights and optimiser state in `train.master_dtype`, forward and backward in
`train.param_dtype` (autocast, or FSDP2's MixedPrecisionPolicy when sharded), log-softmax in
`train.logprob_dtype`; and the FSDP2 keys `fsdp_reshard_after_forward` and `fsdp_offload`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nebula_rl.config import config_from_dict
from nebula_rl.data import sft_example
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.batching import pad_batch
from nebula_rl.policy.setup import load_policy_model, prepare_single_process, rollout_copy
from nebula_rl.policy.trainer import PolicyTrainer, token_logprobs


def _cfg(**train):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-6,
                "optm_warmup_steps": 0,
                "optm_weight_decay": 0.0,
                **train,
                "train_policy": {"type": "sft", "mini_batch": 4},
            },
        }
    )


def _examples():
    tok = build_char_tokenizer()
    return tok, [
        sft_example(
            tok,
            [
                {"role": "user", "content": f"What is {i} + {2 * i}?"},
                {"role": "assistant", "content": f"{i} + {2 * i} = {3 * i}"},
            ],
        )
        for i in range(1, 9)
    ]


def _delta(dtype: torch.dtype, **train) -> tuple[torch.Tensor, PolicyTrainer]:
    """The parameter change (float32) of one AdamW step at lr 1e-6 on a `dtype` model."""
    tok, examples = _examples()
    model = load_model("tiny:qwen2", seed=3, dtype=dtype)
    before = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    trainer = PolicyTrainer(model, _cfg(**train), total_steps=4, pad_id=tok.pad_token_id)
    trainer.sft_step(examples)
    after = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return after - before, trainer


def test_mixed_precision_step_follows_the_float32_step_and_pure_bf16_loses_it():
    reference, _ = _delta(torch.float32)
    mixed, trainer = _delta(torch.float32, param_dtype="bfloat16")
    pure, pure_trainer = _delta(torch.bfloat16, master_dtype="bfloat16", param_dtype="bfloat16")
    assert trainer.compute_dtype == torch.bfloat16  # autocast: no FSDP here
    assert pure_trainer.compute_dtype is None  # the weights are bf16 themselves

    relative_error = float((mixed - reference).norm() / reference.norm())
    cosine = float(F.cosine_similarity(mixed, reference, dim=0))
    print(f"mixed vs fp32: relative error {relative_error:.4f}, cosine {cosine:.5f}")
    assert relative_error < 0.1 and cosine > 0.99
    # ... and the forward really ran in bf16: the update is not the float32 one bit for bit.
    assert not torch.equal(mixed, reference)

    # Pure bf16: a 1e-6 step is far below bf16's resolution at weights of ~0.02 (~1e-4), so
    # most of the update rounds away.
    moved = float((pure != 0).float().mean())
    pure_error = float((pure - reference).norm() / reference.norm())
    print(f"pure bf16: {moved:.4f} of the weights moved, relative error {pure_error:.3f}")
    assert moved < 0.2 and pure_error > 0.5


def test_param_dtype_wider_than_master_is_refused():
    with pytest.raises(ValueError, match=r"train\.param_dtype .* train\.master_dtype"):
        _delta(torch.bfloat16, master_dtype="bfloat16", param_dtype="float32")


def test_policy_loads_in_master_dtype_and_rollout_copy_in_param_dtype():
    cfg = _cfg(master_dtype="float32", param_dtype="bfloat16")
    model = load_policy_model(cfg, device="cpu", seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.dtype for p in rollout_copy(model, cfg.train).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # a copy, not a cast


def test_logits_are_cast_to_logprob_dtype_before_the_log_softmax():
    model = load_model("tiny:qwen2", seed=1)
    x = torch.randint(4, 100, (2, 7))
    lp, _ = token_logprobs(model, x, torch.ones_like(x), logprob_dtype=torch.bfloat16)
    assert lp.dtype == torch.bfloat16
    logits = model(x).logits[:, :-1].to(torch.bfloat16)
    expected = F.log_softmax(logits, -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, rtol=0, atol=0)
    # and the trainer reads train.logprob_dtype
    tok, examples = _examples()
    cfg = config_from_dict(
        {"train": {"logprob_dtype": "bfloat16", "train_policy": {"type": "grpo"}}}
    )
    trainer = PolicyTrainer(model, cfg, total_steps=1, pad_id=tok.pad_token_id)
    batch = pad_batch([(ids, m, [0.0] * len(ids)) for ids, m in examples], torch.zeros(8), 0)
    lp, entropy = trainer.target_logprobs(batch)
    assert lp.dtype == entropy.dtype == torch.bfloat16


def test_fsdp_offload_needs_fsdp_and_a_gpu():
    model = load_model("tiny:qwen2", seed=0)
    with pytest.raises(ValueError, match=r"train\.fsdp_offload"):
        prepare_single_process(model, _cfg(fsdp_offload=True))


@pytest.fixture
def one_rank_mesh():
    """A CPU mesh of one gloo rank in this process (FSDP2 runs on it as on many)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_fsdp_mixed_precision_and_resharding(one_rank_mesh):
    from nebula_rl.policy.parallelize import apply_fsdp

    x = torch.randint(4, 100, (2, 9))
    logits = {}
    for reshard in ("default", "always", "never"):
        model = load_model("tiny:qwen2", seed=3)
        apply_fsdp(model, one_rank_mesh, reshard_after_forward=reshard, param_dtype=torch.bfloat16)
        out = model(x).logits
        logits[reshard] = out
        # After forward a resharded group's registered parameters are its sharded DTensors; a
        # group that keeps its gathered parameters registers the plain tensors.
        layer, root = model.model.layers[0].mlp.up_proj.weight, model.model.embed_tokens.weight
        expected_layer = {"default": True, "always": True, "never": False}[reshard]
        expected_root = {"default": False, "always": True, "never": False}[reshard]
        assert isinstance(layer, DTensor) is expected_layer, reshard
        assert isinstance(root, DTensor) is expected_root, reshard
        out.sum().backward()
        # The master copy stays float32; FSDP2 computes in bf16 itself, so no autocast.
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        trainer = PolicyTrainer(model, _cfg(param_dtype="bfloat16"), total_steps=1, pad_id=0)
        assert trainer.compute_dtype is None
    assert logits["default"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"train\.fsdp_offload"):
        apply_fsdp(load_model("tiny:qwen2", seed=3), one_rank_mesh, offload=True)
