"""LoRA on a language-model policy (`policy.lora`, `nebula_rl.models.lora`): a GRPO step
through the adapters is the step of the merged model, with gradients on the adapters alone; the
policy pushes its adapter and the rollout merges it into the policy's merged weights (through
the real weight group, from one rank or FSDP2 shards, into one rank or two tensor-parallel
ones; `nebula_rl.rollout.lora_merge`); the `--local` engine loads the merged weights; exports
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
from torch.distributed.tensor import DTensor

from member_pool import MemberPool
from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.models import build_char_tokenizer, load_model, load_tokenizer
from nebula_rl.models.export import export_hf
from nebula_rl.models.lora import adapter_parameters, merged_parameters, plain_copy
from nebula_rl.policy.logprobs import token_logprobs
from nebula_rl.policy.setup import (
    load_policy_model,
    parallelize_policy,
    pushed_weights,
    rollout_copy,
    rollout_weights,
)
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.lora_merge import LoraMerge
from nebula_rl.rollout.tensor_parallel import TensorParallel
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
    engine = TorchEngine(rollout_copy(model, cfg.train), max_num_seqs=4, max_model_len=32)
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


def test_the_rollout_adapts_the_modules_the_policy_adapts_and_merges_what_it_pushes():
    """`LoraMerge` finds the policy's adapted modules with their ranks (list targets, patterns,
    "all-linear"), expects exactly the names the policy pushes, and merged from them holds the
    policy's merged weights; B carries the scale, the base and A are the policy's own. A bf16
    engine receives A and B in float32 and rounds the merged weight once."""
    lora = {**LORA, "target_modules": ["q_proj", "o_proj", "up_proj", "down_proj"],
            "r_pattern": {"down_proj": 2}, "alpha_pattern": {"o_proj": 3.0},
            "modules_to_save": ["post_attention_layernorm"]}  # fmt: skip
    for case, dtype in ((LORA, torch.float32), (lora, torch.float32), (LORA, torch.bfloat16)):
        cfg = _cfg(case)
        model = _adapted(cfg)
        with torch.no_grad():  # (the saved norm trained too)
            for name, p in model.named_parameters():
                if ".modules_to_save." in name:
                    p.add_(0.1)
        engine = TorchEngine(
            load_model("tiny:qwen2", seed=99, dtype=dtype), max_num_seqs=4, max_model_len=32
        )
        merge = LoraMerge(engine.model, engine.tp_boxes(), cfg.policy.lora)
        for name, tensor in merge.tensors.items():
            assert tensor.dtype == (torch.float32 if ".lora_" in name else dtype), name
        adapted = {n: m.r["default"] for n, m in model.named_modules() if hasattr(m, "lora_A")}
        assert merge.num_adapted == len(adapted)
        pushed = adapter_parameters(model)
        assert pushed.keys() == merge.tensors.keys()
        for name, tensor in pushed.items():
            assert tuple(tensor.shape) == merge.boxes[name][0], name
            if name.endswith(".lora_A.weight"):
                assert tensor.shape[0] == adapted[name.removesuffix(".lora_A.weight")]
        trainable = {n for n, t in pushed.items() if t.requires_grad}
        assert trainable == {n for n in pushed if ".lora_" in n} | {
            n for n in pushed if "post_attention_layernorm" in n and case is lora
        }
        module = "model.layers.1.self_attn.o_proj"
        scale = model.get_submodule(module).scaling["default"]
        assert scale == (3.0 / 4 if case is lora else 12.0 / 4)
        b = model.get_parameter(f"{module}.lora_B.default.weight")
        torch.testing.assert_close(pushed[f"{module}.lora_B.weight"], scale * b, rtol=0, atol=0)
        assert pushed[f"{module}.base_layer.weight"] is model.get_parameter(
            f"{module}.base_layer.weight"
        )

        def write(merge=merge, pushed=pushed):
            for name, tensor in merge.tensors.items():
                tensor.copy_(pushed[name])
            return 1

        engine.update_weights_with(lambda merge=merge, write=write: merge.after(write()))
        expected = dict(plain_copy(model).named_parameters())
        # (bf16: an adapted weight is rounded twice, as the base and merged; its |W| < 0.2 here)
        atol = 1e-6 if dtype == torch.float32 else 2 * 2**-9 * 0.2
        for name, tensor in engine.model.named_parameters():
            torch.testing.assert_close(tensor.float(), expected[name], rtol=0, atol=atol, msg=name)
        engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Policy -> rollout through the weight group: the policy pushes its adapter, the rollout merges

TIMEOUT = timedelta(seconds=60)
PUSHES = 3  # (zero-copy receivers: pushes 1 and 2 fill the two sets, push 3 is adapter-only)
PROMPTS = [[5, 17, 23, 9], [40, 41, 42]]
PARTIAL = {**LORA, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
           "r_pattern": {"down_proj": 2}, "alpha_pattern": {"o_proj": 3.0}}  # fmt: skip
"""Some of the fused q/k/v and gate/up adapted, some not; column- and row-parallel layers."""


@pytest.fixture(scope="module")
def members():
    pool = MemberPool(3)
    yield pool
    pool.close()


def _world(rank, size, port):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=TIMEOUT,
    )  # fmt: skip


def _full(tensor):
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _generate(engine):
    """Greedy completions of PROMPTS: request id -> (tokens, log-probs)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [GenerationRequest(p, sampling=greedy, request_id=f"r{i}")
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    return {
        o.request_id: (list(o.completions[0].token_ids), list(o.completions[0].logprobs))
        for o in engine.generate(requests)
    }


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _push_body(member, lora, num_policy, tp, ports):
    """Members 0..num_policy-1: a LoRA policy (FSDP2 over them when several), a GRPO step
    before each of PUSHES pushes of `pushed_weights`, all but the first trainable-only (as a
    policy replica pushes). The other `tp` members: a rollout replica of `tp` tensor-parallel
    ranks from other weights, taking each push as a rollout replica's weight thread does
    (zero-copy receiver, `LoraMerge` merging in the same write)."""
    policy_port, rollout_port, weights_port = ports
    parallelism = {"dp_shard_size": num_policy} if num_policy > 1 else None
    cfg = _cfg(lora, parallelism=parallelism)
    rdzv = Rendezvous("127.0.0.1", weights_port, f"lora-{num_policy}-{tp}", num_policy + tp)
    if member >= num_policy:
        return _rollout_member(member - num_policy, cfg, rdzv, num_policy, tp, rollout_port)
    if num_policy > 1:
        _world(member, num_policy, policy_port)
    model = _adapted(cfg)
    tok = build_char_tokenizer()
    groups = _groups(tok, plain_copy(model))
    split = parallelize_policy(model, cfg)
    trainer = PolicyTrainer(
        split.model, cfg, total_steps=10, pad_id=tok.pad_token_id,
        data_parallel=split.data_parallel,
    )  # fmt: skip
    group = build_group(rdzv, rank=member, timeout=TIMEOUT)
    sender = ShardedSender(group, pushed_weights(model), num_senders=num_policy)
    merged, num_bytes = [], []
    for version in range(1, PUSHES + 1):
        trainer.grpo_step(groups)
        weights = merged_parameters(model)
        merged.append({n: _full(t) for n, t in weights.items()})
        pushed = pushed_weights(model)
        handle = sender.push(pushed, version, trainable_only=version > 1)
        num_bytes.append(handle.wait().num_bytes)
    # What the merged weights were, pushed after a step: the adapted weights (and saved modules)
    adapter_bytes = _nbytes(t for t in pushed.values() if t.requires_grad)
    merged_bytes = _nbytes(t for t in weights.values() if t.requires_grad)
    sender.close()
    group.close()
    if num_policy > 1:
        dist.destroy_process_group()
    return merged, num_bytes, adapter_bytes, merged_bytes


def _rollout_member(rank, cfg, rdzv, num_policy, tp, port):
    if tp > 1:
        _world(rank, tp, port)
    engine = TorchEngine(
        load_model("tiny:qwen2", seed=99), max_num_seqs=4, max_model_len=32,
        tensor_parallel=TensorParallel.of() if tp > 1 else None,
    )  # fmt: skip
    merge = LoraMerge(engine.model, engine.tp_boxes(), cfg.policy.lora)
    group = build_group(rdzv, rank=num_policy + rank, timeout=TIMEOUT)
    receiver = ShardedReceiver(
        group, merge.tensors, merge.boxes, num_senders=num_policy, zero_copy=True
    )
    received = []
    for _ in range(PUSHES):
        engine.update_weights_with(lambda: merge.after(receiver.receive()))
        received.append({n: t.detach().clone() for n, t in engine.model.named_parameters()})
    generated = _generate(engine)
    zero_copy = receiver.zero_copy
    receiver.close()
    group.close()
    if tp > 1:
        dist.barrier()
        dist.destroy_process_group()
    return engine.tp_boxes(), received, generated, zero_copy


def _check_merged(results, num_policy, tp):
    """Every rollout rank holds its slices of the policy's merged weights after every push and
    generates what one engine with the whole merged weights generates; the adapter-only push
    moved the adapter's bytes only."""
    merged = results[0][0]
    for rank in range(tp):
        boxes, received, generated, zero_copy = results[num_policy + rank]
        assert zero_copy
        for version in range(PUSHES):
            assert received[version].keys() == merged[version].keys()
            for name, tensor in received[version].items():
                index = tuple(slice(lo, hi) for lo, hi in boxes[name][1])
                want = merged[version][name][index]
                torch.testing.assert_close(tensor, want, rtol=0, atol=1e-6, msg=name)
        # The steps changed the adapted weights, and each push replaced the previous one's
        name = "model.layers.0.self_attn.q_proj.weight"
        assert (received[2][name] - received[0][name]).abs().max() > 0
        model = load_model("tiny:qwen2", seed=99)
        model.load_state_dict(merged[-1], strict=False)
        reference = _generate(TorchEngine(model, max_num_seqs=4, max_model_len=32))
        for rid, (tokens, logprobs) in reference.items():
            assert generated[rid][0] == tokens
            torch.testing.assert_close(
                torch.tensor(generated[rid][1]), torch.tensor(logprobs), rtol=0, atol=1e-5
            )
    num_bytes = [sum(results[r][1][i] for r in range(num_policy)) for i in range(PUSHES)]
    _, _, adapter_bytes, merged_bytes = results[0]
    assert num_bytes[-1] == adapter_bytes  # (each slice is written once, for every TP rank)
    assert adapter_bytes * 10 < merged_bytes < num_bytes[0]
    return num_bytes


def test_rollout_merges_the_pushed_adapter_into_the_policys_merged_weights(members):
    """One policy rank -> one rollout rank: three pushes with a GRPO step before each; the
    rollout's weights are the policy's merged weights after each, and a trainable-only push
    carries the adapter's A/B and the saved modules alone."""
    lora = {**LORA, "modules_to_save": ["post_attention_layernorm"]}
    results = members.run_on(range(2), _push_body, lora, 1, 1, [free_port() for _ in range(3)])
    num_bytes = _check_merged(results, 1, 1)
    assert num_bytes[1] == num_bytes[0]  # (the second zero-copy set's first push: everything)


def test_tp2_rollout_merges_its_slices_of_the_adapter(members):
    """One policy rank -> a rollout of two tensor-parallel ranks, some of the fused q/k/v and
    gate/up adapted and others not: each rank receives B's rows and all of A for a weight split
    by rows, A's columns and all of B for one split by columns, and merges its own slice."""
    results = members.run_on(range(3), _push_body, PARTIAL, 1, 2, [free_port() for _ in range(3)])
    _check_merged(results, 1, 2)


@pytest.mark.slow  # (three spawned processes: about 25 s of CPU)
def test_fsdp2_lora_policy_pushes_its_adapter_shards_to_the_rollout(members):
    """A policy FSDP2-sharded over two ranks: each pushes its rows of A, B (scaled) and the
    base; the rollout merges them into the policy's merged weights."""
    results = members.run_on(range(3), _push_body, LORA, 2, 1, [free_port() for _ in range(3)])
    _check_merged(results, 2, 1)
    for version in range(PUSHES):  # (both policy ranks computed the same merged weights)
        for name, tensor in results[1][0][version].items():
            torch.testing.assert_close(tensor, results[0][0][version][name], rtol=0, atol=0)


@pytest.mark.slow  # (a job: Redis, controller, a policy and a two-rank rollout replica, ~30 s)
def test_lora_job_samples_with_the_weights_the_policy_trains(tmp_path, grpo_job_config):
    """A synchronous LoRA job whose rollout replica has two tensor-parallel ranks (the weight
    thread of rank 0 and the lock-step ranks both merge each push): every step's samples come
    from exactly the policy's current weights, so the PPO ratio against the rollout's log-probs
    is 1 before the step's only update and nothing is clipped."""
    from test_runtime import _check_job, _records, _run_job

    changes = {
        "train": {"optm_lr": 1e-2},
        "policy": {"lora": LORA},
        "rollout": {"parallelism": {"tp_size": 2}},
    }
    run_dir = _run_job(tmp_path, grpo_job_config(changes, allowed=0))
    steps = _check_job(run_dir, allowed=0)
    for m in steps:
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5), m["step"]
        assert m["clip_frac"] == 0.0, m["step"]
    assert len(_records(run_dir)) == len(steps)
