"""Weight sync between parallel layouts (`weights/reshard.py`) and the tensor-parallel engine.

Real spawned processes: the policy ranks form one torch.distributed world (FSDP2 or TP over
gloo), the ranks of each rollout replica another (the engine's TP all-reduces), and all of them
one weight group, as in a job. Each process reports plain data on a queue.
"""

import os
import shutil
import signal
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from member_pool import MemberPool
from nebula_rl.models import load_model
from nebula_rl.policy.parallelize import ParallelDims, parallelize_model
from nebula_rl.rollout.engine import GenerationRequest, SamplingParams
from nebula_rl.rollout.tensor_parallel import TensorParallel, check_divisible
from nebula_rl.rollout.torch_engine import TorchEngine
from nebula_rl.weights import (
    LayoutMismatchError,
    Rendezvous,
    WeightReceiver,
    WeightSender,
    build_group,
    free_port,
    serve_store,
    shared,
)
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender, chunk_box, full_box
from nebula_rl.weights.reshard.plan import _decode, _encode, _Piece, _plan

TIMEOUT = timedelta(seconds=60)
BUCKET_BYTES = 8192  # small: every pair of ranks exchanges several messages
WINDOW = 2
PROMPTS = [[5, 17, 23, 9], [40, 41, 42], [7] * 9]


def _policy_model(seed: int) -> torch.nn.Module:
    """tiny:qwen2 (fp32, tied embeddings), its weights moved away from the init by `seed`."""
    model = load_model("tiny:qwen2", seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _generate(engine: TorchEngine) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy completions of PROMPTS: request id -> (tokens, log-probs)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [
        GenerationRequest(p, sampling=greedy, request_id=f"r{i}") for i, p in enumerate(PROMPTS)
    ]
    return {
        o.request_id: (list(o.completions[0].token_ids), list(o.completions[0].logprobs))
        for o in engine.generate(requests)
    }


# ---------------------------------------------------------------------------------------------
# Member processes


class Members(MemberPool):
    def run(self, body, num: int, *args, timeout_s: float = 120.0) -> dict:
        """body(member, *args) on members 0..num-1; member -> result."""
        return self.run_on(range(num), body, *args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def members():
    pool = Members(5)
    yield pool
    pool.close()


@pytest.fixture
def shm_dir():
    """A directory of /dev/shm (tmpfs, like /dev/shm itself) for this test's shared-memory
    files alone, so that a leftover check does not see other tests' files."""
    path = tempfile.mkdtemp(prefix="nebula-test-", dir=shared.SHM_DIR)
    yield path
    shutil.rmtree(path)


def _world(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=TIMEOUT
    )


def _policy(member: int, layout: str, port: int):
    """This member's policy model, parallelised over a 2-rank world (`layout`: fsdp or tp)."""
    _world(member, 2, port)
    model = _policy_model(seed=1)
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2 if layout == "fsdp" else 1, cp=1,
                        tp=2 if layout == "tp" else 1)  # fmt: skip
    parallelize_model(model, dims, dims.build_mesh("cpu"))
    return model


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective over the policy's world)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _rollout_engine(member_rank: int, port: int) -> TorchEngine:
    """One rank of a TP-2 rollout replica, starting from other weights than the policy's."""
    _world(member_rank, 2, port)
    model = load_model("tiny:qwen2", seed=99)
    return TorchEngine(model, max_num_seqs=4, max_model_len=32, tensor_parallel=TensorParallel.of())


def _local(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return dict(engine.model.named_parameters())


FROZEN = "model.embed_tokens.weight"


def _layout_body(member, layout, declining, zero_copy, shm_dir, policy_port, rollout_port,
                 weights_port):  # fmt: skip
    """Members 0-1: the policy (FSDP2 dp_shard 2, or TP 2); members 2-3: a TP-2 rollout.
    Push 1 sends everything and returns before the rollout takes it (the rollout sleeps first):
    the policy changes every weight at once, and push 2 is trainable-only. Copying receivers:
    the embedding changes too (frozen: it would not change in training, so it shows what is not
    sent). Zero-copy receivers: push 2 still carries every tensor (the first into its set), and
    a third, trainable-only push follows. `declining`: the member that refuses shared memory
    (-1: none)."""
    shared.SHM_DIR = shm_dir
    rdzv = Rendezvous("127.0.0.1", weights_port, f"reshard-{layout}-{declining}-{zero_copy}", 4)
    pushes = 3 if zero_copy else 2
    if member < 2:
        model = _policy(member, layout, policy_port)
        model.get_parameter(FROZEN).requires_grad_(False)
        group = build_group(rdzv, rank=member, timeout=TIMEOUT)
        sender = ShardedSender(
            group, model.named_parameters(), num_senders=2, bucket_bytes=BUCKET_BYTES,
            window=WINDOW, shared_memory=member != declining,
        )  # fmt: skip
        files_after_build = os.listdir(shm_dir)
        fulls = [_full(model)]
        handles = [sender.push(model.named_parameters(), version=1)]
        in_flight = not handles[0].done()
        for version in range(2, pushes + 1):
            with torch.no_grad():  # (push 1 may still be in flight)
                for p in model.parameters():
                    if not zero_copy or p.requires_grad:
                        p.add_(0.5 / version)
            fulls.append(_full(model))  # a collective: both policy ranks
            push = sender.push(model.named_parameters(), version=version, trainable_only=True)
            handles.append(push)
        pushed = [handle.wait().num_bytes for handle in handles]
        sender.close()
        memory = (sender.shared_memory, sender.peak_buffer_bytes, sender.shared_memory_bytes)
        result = (fulls, memory, in_flight, files_after_build, pushed, sender.zero_copy)
    else:
        engine = _rollout_engine(member - 2, rollout_port)
        group = build_group(rdzv, rank=member, timeout=TIMEOUT)
        boxes = engine.tp_boxes()
        receiver = ShardedReceiver(
            group, _local(engine), boxes, num_senders=2, bucket_bytes=BUCKET_BYTES, window=WINDOW,
            shared_memory=member != declining, zero_copy=zero_copy,
        )  # fmt: skip
        time.sleep(0.5)  # push 1 is in flight meanwhile
        engine.update_weights_with(receiver.receive)
        assert engine.policy_version == 1
        afters = [{n: t.clone() for n, t in _local(engine).items()}]
        generated = [_generate(engine)]
        for version in range(2, pushes + 1):
            engine.update_weights_with(receiver.receive)
            assert engine.policy_version == version
            afters.append({n: t.clone() for n, t in _local(engine).items()})
        generated.append(_generate(engine))
        # Zero-copy: every parameter is a view of the set the last push wrote.
        last = receiver._sets[(pushes - 1) % 2] if receiver.zero_copy else None
        in_set = last is not None and all(
            last.data_ptr() <= t.data_ptr() < last.data_ptr() + last.numel()
            for t in _local(engine).values()
        )
        receiver.close()
        memory = (receiver.shared_memory, receiver.peak_buffer_bytes, receiver.shared_memory_bytes)
        result = (boxes, afters, generated, memory, in_set)
    dist.barrier()
    dist.destroy_process_group()
    group.close()
    return result


def _num_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _reference(weights: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], list[float]]]:
    model = load_model("tiny:qwen2", seed=99)
    model.load_state_dict(weights, strict=False)
    return _generate(TorchEngine(model, max_num_seqs=4, max_model_len=32))


@pytest.mark.parametrize(
    ("layout", "declining", "zero_copy"),
    [("fsdp", -1, False), ("tp", -1, False), ("fsdp", -1, True), ("tp", -1, True),
     ("fsdp", 3, True), ("tp", 1, False)],
    ids=["fsdp-shared-memory", "tp-shared-memory", "fsdp-zero-copy", "tp-zero-copy",
         "fsdp-rollout-declines", "tp-policy-declines"],
)  # fmt: skip
def test_policy_shards_reach_a_tp2_rollout_bit_exact(members, shm_dir, layout, declining,
                                                     zero_copy):  # fmt: skip
    """Policy FSDP2 dp_shard 2 (or TP 2) -> rollout TP 2: every rollout rank's slices equal the
    policy's weights bit for bit, also when the policy changed them right after `push`
    returned; a trainable-only push leaves frozen tensors alone; the TP engine then generates
    what one process with the policy's whole weights generates. Through shared memory on one
    host (the rollout copying out of it, or using it in place: zero-copy), or over send/recv
    when any member (`declining`) refuses shared memory."""
    ports = [free_port() for _ in range(3)]
    reports = members.run(_layout_body, 4, layout, declining, zero_copy, shm_dir, *ports)
    fulls, policy_memory, in_flight, files_after_build, pushed, policy_zero_copy = reports[0]
    use_shm = declining == -1
    assert policy_zero_copy == (zero_copy and use_shm)
    assert files_after_build == [], "shared-memory files must be unlinked once mapped"
    assert not os.listdir(shm_dir)
    needs = []
    for member in (2, 3):
        boxes, afters, _, memory, in_set = reports[member]
        assert in_set == (zero_copy and use_shm)
        for version, (after, full) in enumerate(zip(afters, fulls, strict=True), start=1):
            assert set(after) == set(full)
            for name, (shape, box) in boxes.items():
                index = tuple(slice(lo, hi) for lo, hi in box)
                assert tuple(full[name].shape) == tuple(shape)
                expected = fulls[0] if name == FROZEN else full  # (sent once, then frozen)
                assert torch.equal(after[name], expected[name][index]), (version, name)
        # Column- and row-parallel weights really are split: rank 1 holds the second half.
        q_shape, q_box = boxes["model.layers.0.self_attn.q_proj.weight"]
        o_shape, o_box = boxes["model.layers.0.self_attn.o_proj.weight"]
        half = member - 2
        assert q_box[0] == (half * q_shape[0] // 2, (half + 1) * q_shape[0] // 2)
        assert o_box[1] == (half * o_shape[1] // 2, (half + 1) * o_shape[1] // 2)
        assert memory[0] == use_shm
        assert memory[2] == policy_memory[2]  # one footprint, the same pages on every member
        if not use_shm:  # `WINDOW` buckets (+ checksum words) are all a push adds
            assert 0 < memory[1] <= WINDOW * (BUCKET_BYTES + 8)
        needs.append(_num_bytes(afters[0]))
    # Trainable-only pushes skip the frozen embedding; a zero-copy set's first push does not.
    frozen_share = pushed[0] - pushed[-1]
    assert frozen_share > 0
    if zero_copy and use_shm:
        assert pushed[1] == pushed[0]
    shm, peak, shm_bytes = policy_memory
    assert shm == use_shm
    if use_shm:
        assert in_flight, "a shared-memory push must return before the rollout takes it"
        # Memory: two sets laid out like the rollout ranks' tensors, nothing private. A tensor
        # both TP ranks keep whole is stored once: about twice the model (blocks are padded).
        assert peak == 0
        assert 2 * _num_bytes(fulls[0]) <= shm_bytes <= 2 * sum(needs)
        assert shm_bytes <= 2.01 * _num_bytes(fulls[0])
    else:
        assert 0 < peak <= WINDOW * (BUCKET_BYTES + 8) and shm_bytes == 0
    # Both TP ranks sampled the same tokens; one process with the whole weights agrees, after
    # the first push and after the last.
    last = {**fulls[-1], FROZEN: fulls[0][FROZEN]}
    for when, full in ((0, fulls[0]), (1, last)):
        generated_2, generated_3 = reports[2][2][when], reports[3][2][when]
        assert generated_2 == generated_3
        for rid, (tokens, logprobs) in _reference(full).items():
            assert generated_2[rid][0] == tokens
            torch.testing.assert_close(
                torch.tensor(generated_2[rid][1]), torch.tensor(logprobs), atol=1e-5, rtol=0
            )


def _fan_out_body(member, shm_dir, rollout_ports, weights_port):
    """Member 0: a plain (unsharded) policy; members 1-2: rollout replica A (TP 2), which
    receives from the policy; members 3-4: replica B (TP 2), which rank i of A forwards to."""
    shared.SHM_DIR = shm_dir
    push = Rendezvous("127.0.0.1", weights_port, "fan-out-policy", 3, hosted=True)
    if member == 0:
        model = _policy_model(seed=2)
        group = build_group(push, rank=0, timeout=TIMEOUT)
        sender = ShardedSender(group, model.named_parameters(), num_senders=1,
                               bucket_bytes=BUCKET_BYTES, checksum="always")  # fmt: skip
        sender.push(model.named_parameters(), version=1)
        sender.close()
        group.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    replica, tp_rank = divmod(member - 1, 2)
    engine = _rollout_engine(tp_rank, rollout_ports[replica])
    local = _local(engine)
    # Rank i of A and rank i of B: a group per TP rank for the forwarding broadcast.
    forward_rdzv = Rendezvous("127.0.0.1", weights_port, f"fan-out-tp{tp_rank}", 2, hosted=True)
    forward = build_group(forward_rdzv, rank=replica, timeout=TIMEOUT)
    if replica == 0:
        group = build_group(push, rank=1 + tp_rank, timeout=TIMEOUT)
        receiver = ShardedReceiver(group, local, engine.tp_boxes(), num_senders=1,
                                   bucket_bytes=BUCKET_BYTES)  # fmt: skip
        assert receiver.receive() == 1
        receiver.close()
        group.close()
        sender = WeightSender(forward, local)
        sender.push(local, version=1).wait()
        sender.close()
    else:
        version = WeightReceiver(forward, local).receive_into(local)
        assert version == 1
    result = (engine.tp_boxes(), {n: t.clone() for n, t in local.items()}, _generate(engine))
    dist.barrier()
    dist.destroy_process_group()
    forward.close()
    return result


def test_fan_out_to_a_second_tp_replica(members, shm_dir):
    """The replica that received the policy's slices forwards them rank by rank to a second
    replica with the same TP layout: both hold the policy's weights exactly, and generate alike."""
    ports = [free_port(), free_port()]
    store_port = free_port()
    store = serve_store("127.0.0.1", store_port)  # one store for all three groups, as in a job
    reports = members.run(_fan_out_body, 5, shm_dir, ports, store_port)
    del store
    policy = reports[0]
    for member in (1, 2, 3, 4):
        boxes, local, _ = reports[member]
        for name, (_, box) in boxes.items():
            assert torch.equal(local[name], policy[name][tuple(slice(a, b) for a, b in box)]), name
    assert reports[1][2] == reports[3][2] == reports[2][2] == reports[4][2]


def _mismatch_body(member, policy_port, weights_port):
    """The rollout needs tensors the policy lacks (Qwen2's q/k/v biases; a Llama policy): every
    member fails with a clear error instead of exchanging garbage or hanging."""
    rdzv = Rendezvous("127.0.0.1", weights_port, "reshard-mismatch", 2)
    group = build_group(rdzv, rank=member, timeout=TIMEOUT)
    model = load_model("tiny:llama" if member == 0 else "tiny:qwen2", seed=0)
    try:
        if member == 0:
            ShardedSender(group, model.named_parameters(), num_senders=1)
        else:
            params = dict(model.named_parameters())
            boxes = {n: (tuple(p.shape), full_box(p.shape)) for n, p in params.items()}
            ShardedReceiver(group, params, boxes, num_senders=1)
    except LayoutMismatchError as err:
        return str(err)
    finally:
        group.close()
    return None


def test_layout_mismatch_is_an_error_on_every_member(members):
    reports = members.run(_mismatch_body, 2, free_port(), free_port())
    for message in reports.values():
        assert message is not None and "no policy rank has it" in message


def _zero_copy_body(member, shm_dir, port):
    """Member 0: a plain policy with a frozen tensor; members 1-2: two one-rank rollout replicas
    receiving zero-copy, each holding "a" and "b" as consecutive views of one fused tensor (as
    the engine fuses q/k/v) and "frozen" on its own. Three pushes, the last two trainable-only;
    after each, every receiver reports its tensors, whether "a" and "b" are still consecutive
    views of one storage, and where that storage lives."""
    shared.SHM_DIR = shm_dir
    group = build_group(Rendezvous("127.0.0.1", port, "zero-copy", 3), rank=member, timeout=TIMEOUT)
    g = torch.Generator().manual_seed(3)
    weights = {"a": torch.randn(4, 6, generator=g), "b": torch.randn(2, 6, generator=g),
               "frozen": torch.randn(5, generator=g)}  # fmt: skip
    weights["frozen"].requires_grad_(False)
    boxes = {n: (tuple(t.shape), full_box(t.shape)) for n, t in weights.items()}
    try:
        if member == 0:
            for t in (weights["a"], weights["b"]):
                t.requires_grad_(True)
            sender = ShardedSender(group, weights, num_senders=1, checksum="always")
            sent, pushed = [], []
            for version in (1, 2, 3):
                with torch.no_grad():
                    weights["a"].add_(1.0)
                    weights["b"].sub_(1.0)
                sent.append({n: t.detach().clone() for n, t in weights.items()})
                handle = sender.push(weights, version, trainable_only=version > 1)
                pushed.append(handle.wait().num_bytes)
            sender.close()
            return sent, pushed, sender.zero_copy, sender.shared_memory_bytes
        fused = torch.zeros(6, 6)
        local = {"a": fused[:4], "b": fused[4:], "frozen": torch.zeros(5)}
        receiver = ShardedReceiver(group, local, boxes, num_senders=1, zero_copy=True)
        got = []
        for version in (1, 2, 3):
            assert receiver.receive() == version
            a, b = local["a"], local["b"]
            consecutive = (
                a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and b.storage_offset() == a.storage_offset() + a.numel()
            )
            base = receiver._sets[(version - 1) % 2]
            in_set = base.data_ptr() <= a.data_ptr() < base.data_ptr() + base.numel()
            got.append(({n: t.clone() for n, t in local.items()}, consecutive, in_set,
                        a.data_ptr() - base.data_ptr()))  # fmt: skip
        receiver.close()
        return got
    finally:
        group.close()


def test_zero_copy_receivers_use_the_set_and_share_identical_blocks(members, shm_dir):
    """Zero-copy receivers end each push holding views of the set the policy wrote, with their
    fused tensors still consecutive; each set's first push carries the frozen tensor too, later
    trainable-only ones do not; two replicas with identical layouts share one copy in the set."""
    reports = members.run(_zero_copy_body, 3, shm_dir, free_port())
    sent, pushed, zero_copy, shm_bytes = reports[0]
    assert zero_copy
    assert pushed[0] == pushed[1] > pushed[2]  # push 2 is the first into set 1: every tensor
    model_bytes = 4 * (24 + 12 + 5)
    assert 2 * model_bytes <= shm_bytes < 2 * 2 * model_bytes  # one copy for both replicas
    for member in (1, 2):
        for version, (tensors, consecutive, in_set, _) in enumerate(reports[member], 1):
            assert consecutive and in_set, version
            for name, tensor in tensors.items():
                assert torch.equal(tensor, sent[version - 1][name]), (member, version, name)
        assert [r[3] for r in reports[member]] == [r[3] for r in reports[1]]  # the same block
    assert not os.listdir(shm_dir)


def _corrupt_body(member, shm_dir, port):
    """Member 0 pushes one tensor to member 1 through shared memory with a checksum; member 1
    flips a byte of the set after the sender computed it, before receiving."""
    shared.SHM_DIR = shm_dir
    group = build_group(Rendezvous("127.0.0.1", port, "corrupt", 2), rank=member, timeout=TIMEOUT)
    weights = {"w": torch.arange(64.0).view(8, 8)}
    try:
        if member == 0:
            sender = ShardedSender(group, weights, num_senders=1, checksum="always")
            assert sender.shared_memory
            handle = sender.push(weights, version=1)
            try:
                handle.wait()  # the rollout rank reports its failure
            except RuntimeError as err:
                return str(err)
            return "no error"
        receiver = ShardedReceiver(
            group, {"w": torch.zeros(8, 8)}, {"w": ((8, 8), full_box((8, 8)))}, num_senders=1
        )
        time.sleep(0.5)  # the sender packed and checksummed set 0 meanwhile
        receiver._sets[0][100] += 1
        try:
            receiver.receive()
        except ValueError as err:
            receiver.close()  # (the failure still goes to the policy)
            return str(err)
        return "no error"
    finally:
        group.close()


def test_corrupted_shared_memory_is_caught(members, shm_dir):
    reports = members.run(_corrupt_body, 2, shm_dir, free_port())
    assert "rollout rank(s) [0] failed to take version 1" in reports[0]
    assert "from policy rank 0 arrived corrupted on rank 1" in reports[1]


def _transfer_dtype_body(member, shm_dir, port):
    """Member 0 pushes float32 tensors (one of an odd size) and an int64 one as bfloat16 wire
    data through shared memory; member 1 keeps float32."""
    shared.SHM_DIR = shm_dir
    group = build_group(Rendezvous("127.0.0.1", port, "bf16", 2), rank=member, timeout=TIMEOUT)
    g = torch.Generator().manual_seed(5)
    weights = {
        "w": torch.randn(8, 6, generator=g),
        "b": torch.randn(5, generator=g),
        "step": torch.tensor([3, -4], dtype=torch.int64),
    }
    try:
        if member == 0:
            sender = ShardedSender(group, weights, num_senders=1, transfer_dtype=torch.bfloat16)
            sender.push(weights, version=4).wait()
            return weights
        local = {n: torch.zeros_like(t) for n, t in weights.items()}
        boxes = {n: (tuple(t.shape), full_box(t.shape)) for n, t in weights.items()}
        receiver = ShardedReceiver(group, local, boxes, num_senders=1,
                                   transfer_dtype=torch.bfloat16)  # fmt: skip
        version = receiver.receive()
        receiver.close()
        return receiver.shared_memory, version, local
    finally:
        group.close()


def test_transfer_dtype_through_shared_memory(members, shm_dir):
    reports = members.run(_transfer_dtype_body, 2, shm_dir, free_port())
    sent, (shm, version, got) = reports[0], reports[1]
    assert shm and version == 4
    assert torch.equal(got["step"], sent["step"])
    for name in ("w", "b"):
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], sent[name].bfloat16().float()), name


def _dying_body(member, shm_dir, port, when):
    """Member 0 pushes to members 1 and 2 through shared memory; member 2 is killed `when`:
    "mapping" (inside `shared.share`, after rank 0 created the files, before everyone mapped
    them) or "pushing" (a push in flight). What happened to the others is reported."""
    shared.SHM_DIR = shm_dir
    rdzv = Rendezvous("127.0.0.1", port, f"dying-{when}", 3)
    group = build_group(rdzv, rank=member, timeout=timedelta(seconds=20))
    weights = {"w": torch.arange(64.0).view(8, 8)}
    boxes = {"w": ((8, 8), full_box((8, 8)))}

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if member == 2 and when == "mapping":
        shared.torch.from_file = die  # (this process dies: nothing else maps here)
    try:
        if member == 0:
            sender = ShardedSender(group, weights, num_senders=1)
            sender.push(weights, version=1).wait()
        else:
            receiver = ShardedReceiver(group, {"w": torch.zeros(8, 8)}, boxes, num_senders=1)
            if member == 2:
                die()
            receiver.receive()
    except RuntimeError as err:  # the dead member's connections closed
        return f"failed: {err}"
    finally:
        group.close()
    return "no error"


@pytest.mark.parametrize("when", ["mapping", "pushing"])
def test_no_shared_memory_is_left_when_a_member_dies(shm_dir, when):
    """Whenever a member dies, nothing is left in /dev/shm: the files are unlinked as soon as
    every member mapped them, and by every member when building fails."""
    port = free_port()
    pool = MemberPool(3)  # (its member 2 dies: not the module's pool)
    try:
        for member in range(3):
            pool.inboxes[member].put((_dying_body, (shm_dir, port, when)))
        reports = {}
        deadline = time.monotonic() + 60
        while len(reports) < 2 and time.monotonic() < deadline:
            member, status, payload = pool.out.get(timeout=max(deadline - time.monotonic(), 0.1))
            reports[member] = (status, payload)
    finally:
        pool.close()
    assert sorted(reports) == [0, 1], reports
    assert reports[0][0] == "ok" and reports[0][1].startswith("failed"), reports[0]
    if when == "mapping":  # building fails for all; mid-push, rollout rank 0 takes its part
        assert reports[1][0] == "ok" and reports[1][1].startswith("failed"), reports[1]
    assert not os.listdir(shm_dir), "shared-memory files left behind"


# ---------------------------------------------------------------------------------------------
# The plan, without processes


def _piece(name, shape, box, trainable=True):
    return _Piece(name, tuple(shape), box, "torch.float32", trainable)


def test_plan_spreads_replicated_slices_and_splits_large_ones():
    """Two data-parallel replicas of 2 FSDP shards each (4 senders) -> 2 TP receivers."""
    shape = (8, 6)
    senders = [[_piece("w", shape, chunk_box(shape, 0, r % 2, 2))] for r in range(4)]
    receivers = [[_piece("w", shape, chunk_box(shape, 1, r, 2))] for r in range(2)]
    plan = _plan(senders + receivers, 4, bucket_bytes=4 * 6, transfer_dtype=None,
                 trainable_only=False)  # fmt: skip
    by_dst: dict[int, set[int]] = {}
    for m in plan:
        by_dst.setdefault(m.dst, set()).add(m.src)
        assert sum(c.numel for c in m.copies) * 4 <= 4 * 6  # at most one bucket per message
    # Receiver 4 is served by replica 0 (ranks 0, 1), receiver 5 by replica 1 (ranks 2, 3).
    assert by_dst == {4: {0, 1}, 5: {2, 3}}
    assert sum(c.numel for m in plan for c in m.copies) == 8 * 6
    # The order interleaves pairs: the first messages come from different senders.
    assert len({m.src for m in plan[:4]}) == 4


def test_plan_refuses_uncovered_slices_and_skips_frozen_tensors():
    shape = (4, 4)
    receiver = [_piece("w", shape, full_box(shape)), _piece("b", (4,), full_box((4,)))]
    half = [_piece("w", shape, chunk_box(shape, 0, 0, 2)), _piece("b", (4,), full_box((4,)), False)]
    with pytest.raises(LayoutMismatchError, match="cover 8 of the 16"):
        _plan([half, receiver], 1, bucket_bytes=1 << 20, transfer_dtype=None, trainable_only=False)
    whole = [_piece("w", shape, full_box(shape)), _piece("b", (4,), full_box((4,)), False)]
    plan = _plan([whole, receiver], 1, bucket_bytes=1 << 20, transfer_dtype=torch.bfloat16,
                 trainable_only=True)  # fmt: skip
    assert [c.name for m in plan for c in m.copies] == ["w"]
    assert plan[0].dtype == torch.bfloat16
    assert _decode(_encode(whole)) == whole


def test_chunk_box_follows_torch_chunk():
    for n, size in [(10, 4), (8, 2), (3, 4)]:
        parts = torch.arange(n).chunk(size)
        for rank in range(size):
            lo, hi = chunk_box((n,), 0, rank, size)[0]
            expected = parts[rank].tolist() if rank < len(parts) else []
            assert list(range(lo, hi)) == expected


def test_tp_refuses_sizes_that_do_not_divide_the_heads():
    model = load_model("tiny:qwen2", seed=0)
    heads = model.config.num_attention_heads
    with pytest.raises(ValueError, match="tp_size = 3 must divide"):
        check_divisible(model.config, 3 if heads % 3 else 5)


# ---------------------------------------------------------------------------------------------
# The lock-step TP engine


def _nudge(engine: TorchEngine):
    """A weight update both ranks apply locally: every slice + 0.01, version 7."""

    def write() -> int:
        for p in engine.model.parameters():
            p.add_(0.01)
        return 7

    return write


def _lockstep_outputs(
    member, port, *, sampling, update_after, max_num_seqs=4, max_model_len=40, continuation=None
):
    """Rank 0 of a TP-2 lock-step engine generates PROMPTS (2 samples each, with
    `continuation` for multi-turn) under its background loop and takes a weight update after
    `update_after` steps; rank 1 only follows. Each rank's completions by request: (tokens,
    log-probs, version changes, observations)."""
    from nebula_rl.rollout.lockstep import LockstepEngine

    _world(member, 2, port)
    engine = LockstepEngine(load_model("tiny:qwen2", seed=99), max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, tensor_parallel=TensorParallel.of(),
                            seed=3)  # fmt: skip
    if member == 0:
        engine.start()
        futures = [
            engine.submit(
                GenerationRequest(
                    p, n=2, sampling=sampling, request_id=f"r{i}", continuation=continuation
                )
            )
            for i, p in enumerate(PROMPTS)
        ]
        while engine._step_count < update_after:  # the update lands mid-generation
            time.sleep(0.005)
        engine.update_weights_with(_nudge(engine))
        outputs = [f.result(timeout=60) for f in futures]
        engine.stop_followers()
        engine.shutdown()
    else:
        outputs = engine.follow(lambda note: _nudge(engine)())
    dist.barrier()
    dist.destroy_process_group()
    return {
        o.request_id: [
            (c.token_ids, c.logprobs, c.version_changes, c.observations) for c in o.completions
        ]
        for o in outputs
    }


def _lockstep_body(member, port):
    sampling = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    return _lockstep_outputs(member, port, sampling=sampling, update_after=5)


def test_lockstep_tp_ranks_sample_alike_and_update_at_the_same_token(members):
    """Rank 0 runs the background loop and takes a weight update mid-generation; rank 1 only
    follows. Both produce the same sampled tokens, and the version changes at the same token."""
    reports = members.run(_lockstep_body, 2, free_port())
    leader, follower = reports[0], reports[1]
    assert sorted(leader) == sorted(follower) == ["r0", "r1", "r2"]
    changed = 0
    for rid, completions in leader.items():
        for (tokens, logprobs, versions, _), (f_tokens, f_logprobs, f_versions, _) in zip(
            completions, follower[rid], strict=True
        ):
            assert tokens == f_tokens and versions == f_versions
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(f_logprobs))
            changed += any(v == 7 for _, v in versions) and versions[0][1] == 0
    assert changed > 0  # some completion spans the update (started on version 0, ended on 7)


def _observation(index: int, tokens: list[int]) -> list[int] | None:
    """A multi-turn continuation: after a short wait that differs by sample (so answers come
    back in different steps), the first two turns get a 3-token observation made from the turn's
    last token; the third turn ends the conversation."""
    time.sleep(0.002 * (index % 3))
    turns = sum(1 for t in tokens if t in STOPS)
    return None if turns >= 3 else [tokens[-1] % 50 + 10, 11, 12]


STOPS = tuple(range(3, 200, 9))
"""The turn-ending tokens of the lock-step multi-turn test (about one token in nine)."""


def _lockstep_multiturn_body(member, port):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:

        def continuation(index: int, tokens: list[int]):
            return pool.submit(_observation, index, tokens)

        sampling = SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=STOPS)
        return _lockstep_outputs(
            member, port, sampling=sampling, update_after=6,  # (mid-conversation)
            max_num_seqs=6, max_model_len=64, continuation=continuation,
        )  # fmt: skip


def test_lockstep_tp_ranks_append_rank_0s_observations_in_the_same_step(members):
    """Multi-turn conversations on a TP-2 engine: only rank 0 runs the continuations (answers
    coming back at different times); rank 1 appends the same observations in the same steps,
    so both produce the same tokens, log-probs, observations and versions, with a weight update
    landing mid-conversation."""
    reports = members.run(_lockstep_multiturn_body, 2, free_port())
    leader, follower = reports[0], reports[1]
    assert sorted(leader) == sorted(follower) == ["r0", "r1", "r2"]
    observed = 0
    for rid, completions in leader.items():
        for (tokens, logprobs, versions, observations), theirs in zip(
            completions, follower[rid], strict=True
        ):
            assert (tokens, versions, observations) == (theirs[0], theirs[2], theirs[3])
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(theirs[1]))
            for start, end in observations:
                assert tokens[start + 1 : end] == [11, 12]
                assert all(p == 0.0 for p in logprobs[start:end])
            observed += len(observations)
    assert observed >= 2


def _nccl_body(member, port):
    """Member 0 (cuda:0) pushes a bf16 model-like state to member 1 (cuda:1) over NCCL, sliced
    for a TP-2 receiver's first rank (rows 0..half of the weight); member 1 checks the slice."""
    torch.cuda.set_device(member)
    group = build_group(
        Rendezvous("127.0.0.1", port, "nccl", 2), rank=member, backend="nccl", timeout=TIMEOUT
    )
    g = torch.Generator().manual_seed(7)
    weights = {
        "w": torch.randn(16, 8, generator=g).bfloat16().cuda(),
        "b": torch.randn(16, generator=g).cuda(),
    }
    try:
        if member == 0:
            sender = ShardedSender(group, weights, num_senders=1)
            sender.push(weights, version=2).wait()
            return {n: t.cpu() for n, t in weights.items()}
        local = {
            "w": torch.zeros(8, 8, dtype=torch.bfloat16, device="cuda"),
            "b": torch.zeros(16, device="cuda"),
        }
        boxes = {
            "w": ((16, 8), ((0, 8), (0, 8))),
            "b": ((16,), full_box((16,))),
        }
        receiver = ShardedReceiver(group, local, boxes, num_senders=1)
        version = receiver.receive()
        receiver.close()
        return receiver.shared_memory, version, {n: t.cpu() for n, t in local.items()}
    finally:
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_resharded_push_is_bit_exact(members):
    reports = members.run(_nccl_body, 2, free_port())
    sent, (shm, version, got) = reports[0], reports[1]
    assert not shm and version == 2  # (NCCL: point to point, no shared memory)
    assert torch.equal(got["w"], sent["w"][:8]) and torch.equal(got["b"], sent["b"])
