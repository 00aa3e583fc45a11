"""Weight averages of language-model policies (`train.ema_enable`, `policy/ema.py`): cosmos-rl's
formula over real optimiser steps, the keys' checks. Exports, checkpoints and resume are tested
in test_checkpoint.py (one process) and test_sft.py (FSDP2, TP, PP and DDP over two ranks)."""

import pytest
import torch

from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.data import sft_example
from nebula_rl.models import build_char_tokenizer, load_model
from nebula_rl.policy.ema import WeightEMA, ema_folder
from nebula_rl.policy.trainer import PolicyTrainer


def _cfg(**train):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-2,
                "optm_warmup_steps": 0,
                **train,
                "train_policy": {"type": "sft", "mini_batch": 2},
            }
        }
    )


def test_averages_follow_the_warm_up_decay_every_interval_of_optimizer_steps():
    tok = build_char_tokenizer()
    model = load_model("tiny:qwen2", seed=0)
    cfg = _cfg(ema_enable=True, ema_decay=0.2, ema_update_step_interval=2)
    trainer = PolicyTrainer(model, cfg, total_steps=5, pad_id=tok.pad_token_id)
    assert trainer.ema is not None
    examples = [
        sft_example(
            tok,
            [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}],
        )
        for i in range(4)
    ]
    name = "model.layers.0.mlp.up_proj.weight"
    param = dict(model.named_parameters())[name]
    want = param.detach().clone()
    for t in range(5):
        trainer.sft_step(examples)
        if (t + 1) % 2 == 0:  # optimiser steps 1 and 3 (0-based) update the averages
            d = min((1 + t) / (10 + t), 0.2)  # 0.1818.., then capped at 0.2
            want = d * want + (1 - d) * param.detach()
    average = trainer.ema.state()[name]
    torch.testing.assert_close(average, want)
    assert not torch.allclose(average, param.detach())  # they lag the live weights
    assert trainer.ema.steps == 5
    assert set(trainer.ema.state()) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_averages_of_bfloat16_weights_are_kept_in_float32():
    model = load_model("tiny:qwen2", seed=0).to(torch.bfloat16)
    ema = WeightEMA(model, decay=0.9999, interval=1)
    param = model.model.norm.weight
    start = param.detach().float().clone()
    for _ in range(20):  # (steps of 1.0: exact in bfloat16 at these sizes)
        with torch.no_grad():
            param.add_(1.0)
        ema.step()
    want = start.clone()
    for t in range(20):
        d = min((1 + t) / (10 + t), 0.9999)
        want = d * want + (1 - d) * (start + t + 1).to(torch.bfloat16).float()
    (average,) = [a for n, a in ema.state().items() if n == "model.norm.weight"]
    assert average.dtype == torch.float32
    torch.testing.assert_close(average, want)
    with ema.applied():  # (put into the bfloat16 weights for an export)
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param.detach(), want.to(torch.bfloat16))


def test_off_by_default_and_keys_checked_at_load(tmp_path):
    tok = build_char_tokenizer()
    trainer = PolicyTrainer(
        load_model("tiny:qwen2"), _cfg(), total_steps=1, pad_id=tok.pad_token_id
    )
    assert trainer.ema is None
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        _cfg(ema_enable=True, ema_decay=1.5)
    with pytest.raises(ConfigError, match=r"train\.ema_update_step_interval"):
        _cfg(ema_enable=True, ema_update_step_interval=-1)
    assert ema_folder(tmp_path / "safetensors" / "final") == tmp_path / "safetensors" / "final_ema"
