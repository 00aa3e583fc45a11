"""GRPO of vision-language models: the engine generates from images and videos (vision embeddings
in the prefill, M-RoPE, then plain decoding), its log-probs are the policy's, rollout and policy
build the same prompt tokens, tensor-parallel rollouts and data-parallel policies handle media."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from member_pool import MemberPool
from nebula_rl.config import config_from_dict
from nebula_rl.data import squares_task
from nebula_rl.data.vision import VisionProcessor
from nebula_rl.models import load_model, load_tokenizer, media_token_ids
from nebula_rl.policy.batching import rollout_media
from nebula_rl.policy.parallelize import whole_model_loss
from nebula_rl.policy.setup import parallelize_policy
from nebula_rl.policy.trainer import PolicyTrainer
from nebula_rl.protocol import Completion, Prompt, RolloutGroup
from nebula_rl.rollout.build import build_engine
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.tensor_parallel import TensorParallel
from nebula_rl.rollout.text import prompt_inputs
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.weights import free_port

EDGE = "tiny:cosmos3_edge"
PRESETS = ["tiny:qwen3_vl", "tiny:qwen2_5_vl", "tiny:cosmos3_omni", EDGE]


def _frames(num: int) -> list[Image.Image]:
    return [Image.new("RGB", (64, 64), (40 * i % 255, 90, 200 - 30 * i)) for i in range(num)]


def _prompts(rows: list[dict]) -> list[list[dict] | str]:
    """Image prompts, a text-only prompt, and a video given as frames."""
    video = [{"role": "user", "content": [
        {"type": "video", "video": _frames(4), "fps": 2},
        {"type": "text", "text": "What moves?"},
    ]}]  # fmt: skip
    return [rows[0]["prompt"], "How many squares?", rows[1]["prompt"], video]


def _requests(vision: VisionProcessor, tokenizer, prompts, sampling) -> list[GenerationRequest]:
    requests = []
    for i, prompt in enumerate(prompts):
        ids, media = prompt_inputs(tokenizer, vision, prompt)
        requests.append(
            GenerationRequest(ids, n=2, sampling=sampling, media=media, request_id=f"r{i}")
        )
    return requests


def _policy_logprobs(model, request: GenerationRequest, tokens: list[int]) -> torch.Tensor:
    """The policy's log-probs of `tokens` after the request's prompt, through its forward."""
    ids = torch.tensor([[*request.prompt_token_ids, *tokens]])
    media = {}
    if request.media is not None:
        from nebula_rl.data.vision import media_kwargs

        media = media_kwargs([request.media], ids, image_token_id=model.config.image_token_id,
                             video_token_id=model.config.video_token_id)  # fmt: skip
    start = len(request.prompt_token_ids) - 1

    def loss_fn(logits, labels):
        return torch.log_softmax(logits[0, start:-1].float(), -1).gather(-1, labels[:, None])[:, 0]

    with torch.no_grad():
        return whole_model_loss(model, ids, torch.tensor(tokens), loss_fn, backward=False,
                                compute_dtype=None, inputs=media)  # fmt: skip


# (Cosmos 3 Edge's language model, squared-ReLU MLPs, runs through its HF modules only: below)
FORWARDS = [(p, f) for p in PRESETS for f in ("fused", "hf") if (p, f) != (EDGE, "fused")]


@pytest.mark.parametrize(("preset", "forward"), FORWARDS)
def test_engine_logprobs_match_the_policy_on_multimodal_prompts(preset, forward):
    """Images, a text prompt and a video (frames) in one batch: every sampled token's log-prob
    equals the policy's forward (pixels, grids, M-RoPE) within 1e-5 in float32."""
    tokenizer = load_tokenizer(preset)
    model = load_model(preset, dtype=torch.float32, seed=0)
    policy = load_model(preset, dtype=torch.float32, seed=0)
    vision = VisionProcessor(tokenizer, model.config)
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=256, forward=forward)
    assert engine.forward_impl == forward
    requests = _requests(vision, tokenizer, _prompts(squares_task(num_samples=2)),
                         SamplingParams(max_tokens=16, ignore_eos=True, seed=5))  # fmt: skip
    assert [r.media is None for r in requests] == [False, True, False, False]
    assert requests[3].media.video_grid_thw is not None
    outputs = {o.request_id: o for o in engine.generate(requests)}
    worst = 0.0
    for request in requests:
        for completion in outputs[request.request_id].completions:
            assert len(completion.token_ids) == 16
            want = _policy_logprobs(policy, request, completion.token_ids)
            worst = max(worst, float((want - torch.tensor(completion.logprobs)).abs().max()))
    assert worst < 1e-5


def test_cosmos3_edge_runs_through_its_hf_modules_and_refuses_the_compact_forward():
    model = load_model(EDGE, dtype=torch.float32, seed=0)
    assert TorchEngine(model, max_num_seqs=2, max_model_len=64).forward_impl == "hf"
    with pytest.raises(ValueError, match="'cosmos3_edge_text' is not one of"):
        TorchEngine(model, max_num_seqs=2, max_model_len=64, forward="fused")


def test_engine_never_samples_media_tokens_and_refuses_media_it_cannot_place():
    tokenizer = load_tokenizer("tiny:qwen3_vl")
    model = load_model("tiny:qwen3_vl", dtype=torch.float32, seed=0)
    never = set(media_token_ids(model.config))
    assert len(never) == 4
    vision = VisionProcessor(tokenizer, model.config)
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=128)
    # Make the media tokens the most likely ones: the engine still never samples them.
    with torch.no_grad():
        model.lm_head.weight[sorted(never)] *= 50
    requests = _requests(vision, tokenizer, _prompts(squares_task(num_samples=2))[:2],
                         SamplingParams(max_tokens=24, ignore_eos=True, temperature=2.0))  # fmt: skip
    sampled = {t for o in engine.generate(requests) for c in o.completions for t in c.token_ids}
    assert sampled and not sampled & never
    image = requests[0]
    ids = list(image.prompt_token_ids)
    ids.remove(model.config.image_token_id)  # one image token too few
    with pytest.raises(ValueError, match="holds 3 image tokens, its image grids make 4"):
        engine.add_request(dataclasses.replace(image, prompt_token_ids=ids, request_id="x"))
    text_engine = TorchEngine(load_model("tiny:qwen2", seed=0), max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="not a vision-language model"):
        text_engine.add_request(GenerationRequest([1, 2, 3], media=image.media))
    # The vLLM adapter does not pass media yet: a vision-language model is refused by name.
    cfg = config_from_dict({"policy": {"model_name_or_path": "tiny:qwen3_vl"}})
    assert cfg.rollout.backend == "vllm"
    with pytest.raises(ValueError, match=r'rollout\.backend = "vllm": vision-language prompts'):
        build_engine(cfg, model=model, tokenizer=tokenizer, seed=0)


def test_rollout_and_policy_build_the_same_prompt_tokens():
    """The rollout's prompt ids (what it generated from) are the policy's prompt prefix token
    for token, and the policy's media are the rollout's; another image size is refused."""
    tokenizer = load_tokenizer("tiny:qwen3_vl")
    config = load_model("tiny:qwen3_vl", seed=0).config
    rollout_side = VisionProcessor(tokenizer, config)
    policy_side = VisionProcessor.from_pretrained("tiny:qwen3_vl")
    prompts = _prompts(squares_task(num_samples=2))
    groups = []
    for i, prompt in enumerate(prompts):
        ids, media = prompt_inputs(tokenizer, rollout_side, prompt, system_prompt="Count.")
        groups.append(RolloutGroup(Prompt(f"0:{i}", 0, i, prompt, "1"), ids, []))
    media = rollout_media(policy_side, groups, prompts, system_prompt="Count.")
    assert [m is None for m in media] == [False, True, False, False]
    for group, inputs, prompt in zip(groups, media, prompts, strict=True):
        ids, want = prompt_inputs(tokenizer, rollout_side, prompt, system_prompt="Count.")
        assert ids == group.prompt_token_ids
        if inputs is not None:
            assert inputs.input_ids == group.prompt_token_ids
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                got, expected = getattr(inputs, key), getattr(want, key)
                assert (got is None) == (expected is None)
                if got is not None:
                    assert torch.equal(got, expected)
    bigger = [{"role": "user", "content": [
        {"type": "image", "image": prompts[0][0]["content"][0]["image"], "min_pixels": 128 * 128},
        {"type": "text", "text": "How many squares?"},
    ]}]  # fmt: skip
    with pytest.raises(ValueError, match=r"prompt 0:0: the policy builds .* first different at"):
        rollout_media(policy_side, groups[:1], [bigger], system_prompt="Count.")


@pytest.fixture(scope="module")
def members():
    pool = MemberPool(2)
    yield pool
    pool.close()


def _tp_body(member, port):
    from nebula_rl.rollout.lockstep import LockstepEngine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=member,
                            world_size=2)  # fmt: skip
    try:
        tokenizer = load_tokenizer("tiny:qwen3_vl")
        model = load_model("tiny:qwen3_vl", dtype=torch.float32, seed=0)
        engine = LockstepEngine(model, max_num_seqs=8, max_model_len=256, seed=1,
                                tensor_parallel=TensorParallel.of())  # fmt: skip
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if member > 0:
            outputs = engine.follow(lambda note: None)
        else:
            vision = VisionProcessor(tokenizer, model.config)
            requests = _requests(vision, tokenizer, _prompts(squares_task(num_samples=2)),
                                 SamplingParams(max_tokens=12, ignore_eos=True))  # fmt: skip
            outputs = engine.generate(requests)
            engine.stop_followers()
        dist.barrier()
        tokens = {o.request_id: [(c.token_ids, c.logprobs) for c in o.completions] for o in outputs}
        return tokens, shapes
    finally:
        dist.destroy_process_group()


def test_tp2_rollout_generates_like_one_process_from_images_and_video(members):
    """Two tensor-parallel ranks (the vision tower whole on each, the language model split)
    sample the tokens one process samples, with its log-probs."""
    reports = members.run_on(range(2), _tp_body, free_port())
    tokenizer = load_tokenizer("tiny:qwen3_vl")
    model = load_model("tiny:qwen3_vl", dtype=torch.float32, seed=0)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    engine = TorchEngine(model, max_num_seqs=8, max_model_len=256, seed=1)
    requests = _requests(VisionProcessor(tokenizer, model.config), tokenizer,
                         _prompts(squares_task(num_samples=2)),
                         SamplingParams(max_tokens=12, ignore_eos=True))  # fmt: skip
    want = {o.request_id: o.completions for o in engine.generate(requests)}
    for member, (tokens, shapes) in reports.items():
        assert sorted(tokens) == sorted(want)
        for rid, completions in tokens.items():
            for (ids, logprobs), expected in zip(completions, want[rid], strict=True):
                assert ids == expected.token_ids, (member, rid)
                torch.testing.assert_close(torch.tensor(logprobs),
                                           torch.tensor(expected.logprobs), atol=1e-5, rtol=0)  # fmt: skip
        visual = {n for n in full if ".visual." in n}
        assert visual and all(shapes[n] == full[n] for n in visual)
        q = "model.language_model.layers.0.self_attn.q_proj.weight"
        assert shapes[q][0] == full[q][0] // 2


def _groups(vision: VisionProcessor, tokenizer) -> tuple[list[RolloutGroup], list]:
    """Two image groups and one text group, completions of different lengths and rewards."""
    prompts = _prompts(squares_task(num_samples=2))[:3]
    groups = []
    for i, prompt in enumerate(prompts):
        ids, _ = prompt_inputs(tokenizer, vision, prompt)
        texts = [f"<answer>{i + 1}</answer>", "x" * (3 + i), str(i)]
        completions = [
            Completion(
                tokenizer.encode(t) + [tokenizer.eos_token_id],
                [-1.0] * (len(t) + 1),
                t,
                "stop",
                [(0, 0)],
                reward,
            )
            for t, reward in zip(texts, [1.0, 0.0, 0.5], strict=True)
        ]
        groups.append(RolloutGroup(Prompt(f"0:{i}", 0, i, prompt, "1"), ids, completions))
    return groups, prompts


def _cfg(parallelism: dict):
    return config_from_dict({
        "train": {"optm_lr": 1e-3, "optm_warmup_steps": 0, "epsilon": 1e-6,
                  "train_policy": {"type": "grpo", "mini_batch": 1,
                                   "use_rollout_logprobs_for_loss": False}},
        "policy": {"parallelism": parallelism},
    })  # fmt: skip


def _grpo(trainer: PolicyTrainer, tokenizer, vision) -> list[dict]:
    groups, prompts = _groups(vision, tokenizer)
    media = rollout_media(vision, groups, prompts)
    return [trainer.grpo_step(groups, media) for _ in range(2)]


def _two_rank_body(member, port, parallelism, preset):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=member,
                            world_size=2)  # fmt: skip
    try:
        cfg = _cfg(parallelism)
        tokenizer = load_tokenizer(preset)
        model = load_model(preset, seed=0)
        vision = VisionProcessor(tokenizer, model.config)
        split = parallelize_policy(model, cfg)
        trainer = PolicyTrainer(split.model, cfg, total_steps=4, pad_id=0,
                                data_parallel=split.data_parallel)  # fmt: skip
        history = _grpo(trainer, tokenizer, vision)
        params = {n: t.cpu().numpy().copy() for n, t in split.model.full_named_parameters()}
        return history, params
    finally:
        dist.destroy_process_group()


# A vision block's weight of each preset (the images' gradients must reach the tower).
_VISION_WEIGHT = {
    "tiny:qwen3_vl": "model.visual.blocks.0.attn.qkv.weight",
    EDGE: "model.visual.encoder.layers.0.self_attn.q_proj.weight",  # (SigLIP2's tower)
}


@pytest.mark.parametrize("preset", list(_VISION_WEIGHT))
@pytest.mark.parametrize("parallelism", [{"dp_shard_size": 2}, {"tp_size": 2}], ids=str)
def test_two_rank_grpo_on_images_steps_like_one_process(members, parallelism, preset):
    """One pass per row (mini_batch 1) over 9 rows. FSDP2: the ranks' passes hold images, text
    only, or nothing (a dummy row), and still pair their vision-block collectives up. TP: the
    language model split over the two ranks (Cosmos 3 Edge's squared-ReLU MLPs by their fc1
    and fc2), the vision tower (and a projector outside it) sharded over them. Two steps equal
    one process's."""
    cfg = _cfg({})
    tokenizer = load_tokenizer(preset)
    model = load_model(preset, seed=0)
    vision = VisionProcessor(tokenizer, model.config)
    trainer = PolicyTrainer(model, cfg, total_steps=4, pad_id=0)
    want = _grpo(trainer, tokenizer, vision)
    reports = members.run_on(
        range(2), _two_rank_body, free_port(), parallelism, preset, timeout_s=240
    )
    start = dict(load_model(preset, seed=0).named_parameters())
    for history, params in reports.values():
        for got, expected in zip(history, want, strict=True):
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        for name, value in params.items():
            torch.testing.assert_close(torch.from_numpy(value), model.get_parameter(name).detach(),
                                       rtol=0, atol=1e-5)  # fmt: skip
    name = _VISION_WEIGHT[preset]
    moved = float((model.get_parameter(name) - start[name]).detach().abs().max())
    assert moved > 1e-4  # the images' gradients reached the vision tower


def _weights_body(member, policy_port, rollout_port, weights_port, shm_dir):
    """Members 0-1: a TP-2 policy of tiny:qwen3_vl (its weights moved off the init); members
    2-3: a TP-2 rollout replica of it starting from other weights. One push, zero-copy through
    shared memory as in jobs."""
    from datetime import timedelta

    from nebula_rl.policy.parallelize import ParallelDims, parallelize_model
    from nebula_rl.weights import Rendezvous, build_group, shared
    from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender

    shared.SHM_DIR = shm_dir
    timeout = timedelta(seconds=60)
    rank, port = (member, policy_port) if member < 2 else (member - 2, rollout_port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timeout)  # fmt: skip
    rdzv = Rendezvous("127.0.0.1", weights_port, "vlm-tp-push", 4)
    if member < 2:
        model = load_model("tiny:qwen3_vl", seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2)
        parallelize_model(model, dims, dims.build_mesh("cpu"))
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        group = build_group(rdzv, rank=member, timeout=timeout)
        sender = ShardedSender(group, model.named_parameters(), num_senders=2)
        sender.push(model.named_parameters(), version=1).wait()
        sender.close()
        result = ({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                  placements)  # fmt: skip
    else:
        engine = TorchEngine(load_model("tiny:qwen3_vl", seed=99), max_num_seqs=4,
                             max_model_len=256, tensor_parallel=TensorParallel.of())  # fmt: skip
        group = build_group(rdzv, rank=member, timeout=timeout)
        boxes = engine.tp_boxes()
        receiver = ShardedReceiver(group, dict(engine.model.named_parameters()), boxes,
                                   num_senders=2, zero_copy=True)  # fmt: skip
        engine.update_weights_with(receiver.receive)
        local = {n: t.detach().clone() for n, t in engine.model.named_parameters()}
        receiver.close()
        result = (boxes, local, engine.policy_version)
    dist.barrier()
    dist.destroy_process_group()
    group.close()
    return result


def test_tp2_policy_of_a_vision_language_model_pushes_its_weights_to_a_tp2_rollout():
    """Policy TP 2 (language model split, vision tower FSDP-sharded over the TP ranks: two
    kinds of DTensor on two meshes) -> rollout TP 2 (vision tower whole on each rank): every
    rollout rank holds its slice of every policy weight, bit for bit."""
    import shutil
    import tempfile

    from nebula_rl.weights import shared

    shm_dir = tempfile.mkdtemp(prefix="nebula-test-", dir=shared.SHM_DIR)
    pool = MemberPool(4)
    try:
        ports = [free_port() for _ in range(3)]
        reports = pool.run_on(range(4), _weights_body, *ports, shm_dir, timeout_s=180)
    finally:
        pool.close()
        shutil.rmtree(shm_dir)
    full, placements = reports[0]
    assert "Shard(dim=0)" in placements["model.visual.blocks.0.attn.qkv.weight"]
    assert "Shard(dim=1)" in placements["model.language_model.layers.0.self_attn.o_proj.weight"]
    for member in (2, 3):
        boxes, local, version = reports[member]
        assert version == 1 and set(local) == set(full)
        for name, (shape, box) in boxes.items():
            assert tuple(full[name].shape) == tuple(shape)
            index = tuple(slice(lo, hi) for lo, hi in box)
            assert torch.equal(local[name], full[name][index]), (member, name)
        qkv = "model.visual.blocks.0.attn.qkv.weight"
        assert [tuple(b) for b in boxes[qkv][1]] == [(0, n) for n in full[qkv].shape]  # whole
        q = "model.language_model.layers.0.self_attn.q_proj.weight"
        rows, half = full[q].shape[0], member - 2
        assert tuple(boxes[q][1][0]) == (half * rows // 2, (half + 1) * rows // 2)
