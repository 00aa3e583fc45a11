"""LoRA on a language-model policy (`policy.lora`, `nebula_rl.models.lora`): a GRPO step
through the adapters is the step of the merged model, with gradients on the adapters alone; the
rollout receives the merged weights (from FSDP2 shards, through the real weight group); exports
load as a Hugging Face model and as a peft adapter, which `lora_path` starts from; checkpoints
hold the adapter and resume. The demo's learning test is in test_recipes.py (its warm start)."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from member_pool import MemberPool
from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model, load_tokenizer
from nebula_rl.models.export import export_hf
from nebula_rl.models.lora import merged_parameters, plain_copy
from nebula_rl.policy.logprobs import token_logprobs
from nebula_rl.policy.setup import (
    load_policy_model,
    parallelize_policy,
    rollout_copy,
    rollout_weights,
)
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.weights import Rendezvous, build_group, free_port
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender

LORA = {"r": 4, "lora_alpha": 12.0, "target_modules": "all-linear"}


def _cfg(lora=None, parallelism=None, **train):
    return config_from_dict(
        {
            "train": {
                "optm_lr": 1e-3,
                "optm_warmup_steps": 0,
                "optm_grad_norm_clip": 0.0,
                "train_policy": {"type": "grpo", "mini_batch": 8, "loss_type": "token-mean"},
                **train,
            },
            "policy": {
                "model_name_or_path": "tiny:qwen2",
                "lora": LORA if lora is None else lora,
                "parallelism": parallelism or {},
            },
        },
        source="test",
    )


def _adapted(cfg, seed=1):
    """The policy with its adapter's B moved off zero (an adapter that changes the model)."""
    model = load_policy_model(cfg, device="cpu", seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _groups(tok, model, *, shift=0.3):
    """Two groups whose log-probs are `model`'s minus `shift` (stale samples: some clipping)."""
    groups = []
    for i, (prompt, answers, rewards) in enumerate(
        [("7+1=", ["8", "3", "15"], [1.0, 0.0, 0.0]), ("2+4=", ["6", "24", "9"], [1.0, 0.0, 1.0])]
    ):
        ids = tok.encode(prompt)
        comps = []
        for a, r in zip(answers, rewards, strict=True):
            tokens = tok.encode(a) + [tok.eos_token_id]
            with torch.no_grad():
                x = torch.tensor([ids + tokens])
                lp, _ = token_logprobs(model, x, torch.ones_like(x))
            own = [v - shift for v in lp[0, len(ids) - 1 :].tolist()]
            comps.append(Completion(tokens, own, a, "stop", [(0, 0)], r))
        groups.append(RolloutGroup(Prompt(f"0:{i}", 0, i, prompt, ""), ids, comps))
    return groups


def _sgd(trainer):
    """SGD at lr 1: a parameter's change is minus its gradient."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)


def test_lora_config_loads_for_language_models_and_refuses_what_it_cannot_do():
    cfg = _cfg()
    assert cfg.policy.lora is not None and cfg.policy.lora.r == 4
    cases = {
        "policy.lora.lora_names": {"lora": {**LORA, "lora_names": ["a", "b"]}},
        "policy.lora.primary_adapter": {"lora": {**LORA, "primary_adapter": "other"}},
        'policy.lora.init_lora_weights = "eva"': {"lora": {**LORA, "init_lora_weights": "eva"}},
        "tp_size or pp_size": {"lora": LORA, "parallelism": {"tp_size": 2}},
    }
    for needle, kwargs in cases.items():
        with pytest.raises(ConfigError, match=re.escape(needle)):
            _cfg(**kwargs)
    with pytest.raises(ConfigError, match=r"train\.compile"):
        _cfg(compile=True)
    with pytest.raises(ValueError, match=r"policy\.lora\.target_modules"):
        load_policy_model(_cfg(lora={"r": 4}), device="cpu", seed=0)
    with pytest.raises(ValueError, match="tie_word_embeddings"):  # (tiny:qwen2 ties its head)
        load_policy_model(_cfg(lora={**LORA, "modules_to_save": ["lm_head"]}), device="cpu", seed=0)


def test_grpo_step_through_adapters_is_the_step_of_the_merged_model():
    """Loss and log-probs through the adapters equal the merged dense model's; only the
    adapter's tensors get gradients and sit in the optimiser, and they are the merged model's
    gradient carried through W = W0 + s B A (dL/dB = s dL/dW A^T, dL/dA = s B^T dL/dW)."""
    tok = build_char_tokenizer()
    cfg = _cfg()
    model = _adapted(cfg)
    merged = plain_copy(model).requires_grad_(True)
    groups = _groups(tok, merged)
    lora_trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    in_optimizer = {id(p) for g in lora_trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in adapters.values()}
    plain_cfg = _cfg()
    plain_cfg.policy.lora = None
    plain_trainer = PolicyTrainer(merged, plain_cfg, total_steps=10, pad_id=tok.pad_token_id)
    _sgd(lora_trainer)
    _sgd(plain_trainer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dense_before = {n: p.detach().clone() for n, p in merged.named_parameters()}
    m_lora = lora_trainer.grpo_step(groups)
    m_plain = plain_trainer.grpo_step(groups)
    for key in ("loss", "pg_loss", "ratio_mean", "clip_frac", "entropy"):
        assert m_lora[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-6), key
    assert 0 < m_lora["clip_frac"] < 1  # (the ratios moved: a loss that depends on them)
    for name, p in model.named_parameters():
        if name not in adapters:
            torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    module = "model.layers.1.mlp.down_proj"
    scale = model.get_submodule(module).scaling["default"]
    a, b = before[f"{module}.lora_A.default.weight"], before[f"{module}.lora_B.default.weight"]
    grad_w = dense_before[f"{module}.weight"] - merged.get_parameter(f"{module}.weight")
    grad_a = a - model.get_parameter(f"{module}.lora_A.default.weight")
    grad_b = b - model.get_parameter(f"{module}.lora_B.default.weight")
    assert grad_b.abs().max() > 0
    torch.testing.assert_close(grad_b, scale * grad_w @ a.T, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(grad_a, scale * b.T @ grad_w, rtol=1e-3, atol=1e-7)


def test_export_loads_as_a_model_and_as_a_peft_adapter_that_lora_path_starts_from(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _cfg({**LORA, "use_rslora": True, "r_pattern": {"down_proj": 2}})
    model = _adapted(cfg)
    x = torch.randint(4, 300, (2, 9))
    with torch.no_grad():
        expected = model(x).logits
        assert (expected - load_model("tiny:qwen2", seed=0)(x).logits).abs().max() > 1e-3
    export_hf(model, load_tokenizer("tiny:qwen2"), tmp_path / "export")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    adapter = tmp_path / "export" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_rslora"] is True
    peft_model = PeftModel.from_pretrained(load_model("tiny:qwen2", seed=0), adapter)
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(peft_model(x).logits, expected, rtol=1e-4, atol=1e-5)
    # lora_path: the same base with the saved adapter
    started = _cfg({**LORA, "use_rslora": True, "r_pattern": {"down_proj": 2},
                    "lora_path": str(adapter)})  # fmt: skip
    with torch.no_grad():
        got = load_policy_model(started, device="cpu", seed=0)(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    other = {**started.policy.lora.model_dump(), "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=r"policy\.lora\.lora_path: the adapter's modules"):
        load_policy_model(_cfg(other), device="cpu", seed=0)
    with pytest.raises(ValueError, match=r"policy\.lora\.lora_path.*use_rslora"):
        load_policy_model(_cfg({**LORA, "lora_path": str(adapter)}), device="cpu", seed=0)


def test_local_run_checkpoints_the_adapter_and_resumes_like_an_uninterrupted_run(
    grpo_job_config, tmp_path
):
    from nebula_rl.local import run

    lora = {"policy": {"lora": {**LORA, "lora_alpha": 8.0}}}
    ckpt = {"enable_checkpoint": True, "save_freq": 2, "export_safetensors": False}
    full = grpo_job_config(lora, {"train": {"max_num_steps": 3, "ckpt": ckpt}}, timestamp="a")
    run_dir = run(full)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_2 = run_dir / "checkpoints" / "step_2"
    saved = dcp.FileSystemReader(str(step_2)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    resumed = grpo_job_config(
        lora, {"train": {"max_num_steps": 3, "resume": str(step_2)}}, timestamp="b"
    )
    again = run(resumed)
    last = json.loads((again / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3
    for key in ("loss", "reward_mean", "entropy"):
        assert last[key] == records[-1][key], key
    final = again / "safetensors" / "final"
    assert (final / "model.safetensors").is_file()
    assert (final / "adapter" / "adapter_model.safetensors").is_file()


def test_local_engine_takes_the_merged_weights_and_samples_as_the_adapted_policy():
    """The `--local` path: the engine's copy (`rollout_copy`) and the weights it loads after a
    step (`rollout_weights`) are the merged policy, without peft; a second load replaces the
    first (no adapter delta accumulates)."""
    tok = build_char_tokenizer()
    cfg = _cfg()
    model = _adapted(cfg)
    engine = TorchEngine(rollout_copy(model, cfg), max_num_seqs=4, max_model_len=32)
    assert not any("lora" in n for n, _ in engine.model.named_parameters())
    trainer = PolicyTrainer(model, cfg, total_steps=10, pad_id=tok.pad_token_id)
    for version in (1, 2):
        trainer.grpo_step(_groups(tok, plain_copy(model)))
        engine.update_weights(rollout_weights(model), policy_version=version)
    expected = dict(plain_copy(model).named_parameters())
    for name, tensor in engine.model.named_parameters():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    x = torch.tensor([tok.encode("7+1=8")])
    with torch.no_grad():
        got, _ = token_logprobs(engine.model, x, torch.ones_like(x))
        want, _ = token_logprobs(model, x, torch.ones_like(x))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# FSDP2 policy -> rollout, through the weight group

TIMEOUT = timedelta(seconds=60)


@pytest.fixture(scope="module")
def members():
    pool = MemberPool(3)
    yield pool
    pool.close()


def _fsdp_push_body(member, policy_port, weights_port):
    """Members 0-1: a LoRA policy on FSDP2 (dp_shard 2), one GRPO step, then a push; another
    step and a trainable-only push. Member 2: a rollout engine from other weights."""
    rdzv = Rendezvous("127.0.0.1", weights_port, "lora-fsdp", 3)
    if member == 2:
        engine = TorchEngine(load_model("tiny:qwen2", seed=99), max_num_seqs=4, max_model_len=32)
        group = build_group(rdzv, rank=member, timeout=TIMEOUT)
        local = dict(engine.model.named_parameters())
        receiver = ShardedReceiver(group, local, engine.tp_boxes(), num_senders=2)
        received = []
        for _ in range(2):
            engine.update_weights_with(receiver.receive)
            received.append({n: t.clone() for n, t in engine.model.named_parameters()})
        receiver.close()
        group.close()
        return received
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{policy_port}", rank=member, world_size=2,
        timeout=TIMEOUT,
    )  # fmt: skip
    try:
        cfg = _cfg(parallelism={"dp_shard_size": 2})
        model = _adapted(cfg)
        tok = build_char_tokenizer()
        groups = _groups(tok, plain_copy(model))
        split = parallelize_policy(model, cfg)
        trainer = PolicyTrainer(
            split.model, cfg, total_steps=10, pad_id=tok.pad_token_id,
            data_parallel=split.data_parallel,
        )  # fmt: skip
        sharded = [n for n, p in model.named_parameters() if p.requires_grad]
        group = build_group(rdzv, rank=member, timeout=TIMEOUT)
        sender = ShardedSender(group, rollout_weights(model), num_senders=2)
        pushed = []
        for version in (1, 2):
            trainer.grpo_step(groups)
            weights = merged_parameters(model)
            pushed.append({n: t.full_tensor().detach().clone() for n, t in weights.items()})
            sender.push(weights, version, trainable_only=version > 1).wait()
        sender.close()
        group.close()
        return pushed, sharded
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # (three spawned processes: about 25 s of CPU)
def test_fsdp2_lora_policy_pushes_the_merged_weights_to_the_rollout(members):
    results = members.run_on(range(3), _fsdp_push_body, free_port(), free_port())
    (pushed, sharded), (pushed_1, _) = results[0], results[1]
    received = results[2]
    assert sharded and all("lora_" in n for n in sharded)
    for version in range(2):
        assert pushed[version].keys() == received[version].keys()
        for name, tensor in received[version].items():
            torch.testing.assert_close(tensor, pushed[version][name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(pushed_1[version][name], pushed[version][name])
    # The second step changed the merged weights, and the push replaced the first's
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (received[1][name] - received[0][name]).abs().max() > 0
