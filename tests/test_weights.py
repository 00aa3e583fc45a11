"""Weight transport between separately started processes: 1 sender + 2 receivers over gloo.

The group members are real processes from the 'spawn' context (not torchrun), started once per
module; they report plain Python data on a queue and leave with `os._exit`.
"""

import glob
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from member_pool import MemberPool
from nebula_rl.controller import JobState, connect, start_redis
from nebula_rl.weights import (
    BucketLayout,
    LayoutMismatchError,
    Rendezvous,
    WeightReceiver,
    WeightSender,
    build_group,
    free_port,
    transport,
    weight_backend,
)
from nebula_rl.weights.elastic import ElasticReceiver, ElasticSender, is_collective_failure
from nebula_rl.weights.group import Generation, gloo_address, leave_group
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender, full_box

TIMEOUT = timedelta(seconds=30)  # a failing test errors out instead of hanging
BUCKET_BYTES = 4096  # small, so the test state dict spans several buckets per dtype


def _full_boxes(tensors: dict[str, torch.Tensor]) -> dict:
    """Each tensor held whole (a rollout without tensor parallelism)."""
    return {name: (tuple(t.shape), full_box(t.shape)) for name, t in tensors.items()}


def _state_dict(version: int) -> dict[str, torch.Tensor]:
    """A small model-like state dict with odd shapes and several dtypes; values depend on version."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "embed.weight": torch.randn(37, 13, generator=g),
        "layers.0.attn.qkv.weight": torch.randn(39, 13, generator=g).bfloat16(),
        "layers.0.attn.qkv.bias": torch.randn(39, generator=g).bfloat16(),
        "layers.0.mlp.up.weight": torch.randn(3, 5, 7, generator=g),
        "layers.0.norm.weight": torch.randn(13, generator=g).half(),
        "lm_head.weight": torch.randn(2000, generator=g),  # > BUCKET_BYTES: a bucket of its own
        "rope.inv_freq": torch.randn(1, generator=g),
        "step": torch.tensor([version, -version], dtype=torch.int64),
    }


class Members(MemberPool):
    """Three member processes that play one member each of successive weight groups.

    Each scenario builds a new group under a new name on the same TCPStore (hosted by member 0),
    which is also how a group is rebuilt after a failure.
    """

    def __init__(self, num_procs: int = 3) -> None:
        super().__init__(num_procs)
        self.port = free_port()
        self.num_groups = 0

    def run(self, body, world_size: int, *args, ranks=None, timeout_s: float = 60.0) -> dict:
        """body(rank, rdzv, *args) on each of `ranks` (default: all of the group); rank -> result."""
        self.num_groups += 1
        rdzv = Rendezvous("127.0.0.1", self.port, f"group-{self.num_groups}", world_size)
        ranks = range(world_size) if ranks is None else ranks
        return self.run_on(ranks, body, rdzv, *args, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def members():
    pool = Members()
    yield pool
    pool.close()


_KEEP = []  # groups left open on purpose (a member that stays alive without pushing)


# Bodies live at module level so that 'spawn' can import them by name.
def _sync_body(rank, rdzv, declining_rank):
    group = build_group(rdzv, rank=rank, backend="gloo", timeout=TIMEOUT)
    if rank == 0:
        sender = WeightSender(group, _state_dict(0), bucket_bytes=BUCKET_BYTES, checksum="always")
        mode = sender.shared_memory
        not_done = []
        for version in (1, 2, 3):
            params = _state_dict(version)
            handle = sender.push(params, version)
            # The receivers sleep before each receive, so the broadcast cannot be finished yet.
            not_done.append(not handle.done())
            for t in params.values():  # the trainer's next step changes its parameters at once
                t.add_(1000)
            handle.wait()
        sender.close()
        result = not_done
    else:
        receiver = WeightReceiver(
            group,
            _state_dict(0),
            bucket_bytes=BUCKET_BYTES,
            shared_memory=rank != declining_rank,
        )
        mode = receiver.shared_memory
        assert len(receiver.layout.bucket_numels) > 3
        result = []
        for _ in range(3):
            time.sleep(0.5)
            version, received = receiver.receive()
            expected = _state_dict(version)
            same = all(
                received[k].dtype == v.dtype and torch.equal(received[k], v)
                for k, v in expected.items()
            )
            result.append((version, same, sorted(received) == sorted(expected)))
    group.close()
    return mode, result


@pytest.mark.parametrize("declining_rank", [-1, 2], ids=["shared-memory", "broadcast"])
def test_three_pushes_arrive_bit_exact_in_order_with_snapshot_semantics(members, declining_rank):
    """On one host the buckets go through shared memory; if any receiver declines it, all
    members fall back to the broadcast. Either way: bit-exact, in order, snapshots."""
    reports = members.run(_sync_body, 3, declining_rank)
    shared = declining_rank == -1
    assert reports[0] == (shared, [True, True, True]), "push must return before the transfer ends"
    for rank in (1, 2):
        assert reports[rank] == (shared, [(1, True, True), (2, True, True), (3, True, True)])
    assert not glob.glob("/dev/shm/nebula-weights-*"), "shared-memory files left behind"


def _transfer_dtype_body(rank, rdzv):
    group = build_group(rdzv, rank=rank, timeout=TIMEOUT)
    if rank == 0:
        sender = WeightSender(group, _state_dict(0), transfer_dtype=torch.bfloat16)
        sender.push(_state_dict(5).items(), 5).wait()  # (name, tensor) pairs work as well
        sender.close()
        result = None
    else:
        # The rollout model keeps float32 weights; it builds its layout from a meta copy.
        model = {k: torch.zeros_like(v) for k, v in _state_dict(0).items()}
        meta = {k: v.to("meta") for k, v in model.items()}
        receiver = WeightReceiver(group, meta, transfer_dtype=torch.bfloat16)
        version = receiver.receive_into(model)
        expected = _state_dict(5)
        result = (version, [k for k, v in expected.items() if not _bf16_equal(model[k], v)])
    group.close()
    return result


def _bf16_equal(got, want):
    if not want.is_floating_point():
        return torch.equal(got, want)
    return got.dtype == want.dtype and torch.equal(got, want.bfloat16().to(want.dtype))


def test_transfer_dtype_and_receive_into(members):
    reports = members.run(_transfer_dtype_body, 2)
    assert reports[1] == (5, [])


def _mismatch_body(rank, rdzv):
    group = build_group(rdzv, rank=rank, timeout=TIMEOUT)
    state = _state_dict(0)
    if rank == 2:  # this rollout model has one tensor of another shape
        state["embed.weight"] = torch.zeros(38, 13)
    try:
        if rank == 0:
            WeightSender(group, state, bucket_bytes=BUCKET_BYTES).push(state, 1).wait()
        else:
            WeightReceiver(group, state, bucket_bytes=BUCKET_BYTES).receive()
    except LayoutMismatchError as err:
        return str(err)
    finally:
        group.close()
    return "no error"


def test_layout_mismatch_raises_on_every_rank(members):
    start = time.monotonic()
    reports = members.run(_mismatch_body, 3)
    assert time.monotonic() - start < TIMEOUT.total_seconds()
    for rank in (0, 1):
        assert "rank(s) [2] built a different weight layout" in reports[rank]
    assert "rank(s) [0, 1] built a different weight layout" in reports[2]


def _misuse_body(rank, rdzv):
    group = build_group(rdzv, rank=rank, timeout=TIMEOUT)  # a group of one: the sender alone
    sender = WeightSender(group, _state_dict(0))
    errors = []
    for bad_push in (
        lambda: sender.push({k: v for k, v in _state_dict(1).items() if k != "step"}, 1),
        lambda: sender.push({**_state_dict(1), "extra": torch.zeros(1)}, 1),
        lambda: sender.push({**_state_dict(1), "step": torch.zeros(3, dtype=torch.int64)}, 1),
    ):
        try:
            bad_push()
        except ValueError as err:
            errors.append(str(err))
    sender.push(_state_dict(2), 2).wait()
    try:
        sender.push(_state_dict(2), 2)
    except ValueError as err:
        errors.append(str(err))
    try:
        WeightReceiver(group, _state_dict(0))
    except ValueError as err:
        errors.append(str(err))
    sender.close()
    group.close()
    return errors


def test_sender_rejects_wrong_pushes(members):
    errors = members.run(_misuse_body, 1)[0]
    assert len(errors) == 5
    assert "push is missing 1 tensor(s), e.g. ['step']" in errors[0]
    assert "'extra' is not in the weight layout" in errors[1]
    assert "'step' has shape (3,), the layout has (2,)" in errors[2]
    assert "version must increase: got 2 after 2" in errors[3]
    assert "a WeightReceiver needs rank > 0" in errors[4]


def _corrupt_body(rank, rdzv):
    group = build_group(rdzv, rank=rank, timeout=TIMEOUT)
    if rank == 0:
        WeightSender(group, _state_dict(0)).push(_state_dict(1), 1).wait()
        group.close()
        return None
    checksum = transport._checksum
    transport._checksum = lambda buffers: 12345  # as if a byte had flipped on the way
    try:
        WeightReceiver(group, _state_dict(0)).receive()
    except ValueError as err:
        return str(err)
    finally:
        transport._checksum = checksum  # this member process serves later tests too
        group.close()
    return "no error"


def test_first_push_is_checksummed(members):
    assert "arrived corrupted on rank 1" in members.run(_corrupt_body, 2)[1]


def _absent_body(rank, rdzv, timeout_s):
    start = time.monotonic()
    try:
        build_group(rdzv, rank=rank, timeout=timedelta(seconds=timeout_s))
    except TimeoutError as err:
        return str(err), time.monotonic() - start
    return "joined", time.monotonic() - start


def test_receiver_that_never_joins_times_out(members):
    timeout_s = 2.0
    reports = members.run(_absent_body, 3, timeout_s, ranks=[0, 1])  # rank 2 never comes
    for rank in (0, 1):
        message, elapsed = reports[rank]
        assert "rank(s) [2] of 3 did not join within 2s" in message
        assert elapsed < timeout_s + 5


def _no_push_body(rank, rdzv, timeout_s):
    group = build_group(rdzv, rank=rank, timeout=TIMEOUT)
    _KEEP.append(group)
    if rank == 0:  # the sender stays alive and connected but never pushes
        _KEEP.append(WeightSender(group, _state_dict(0)))
        return None
    receiver = WeightReceiver(group, _state_dict(0))
    start = time.monotonic()
    try:
        receiver.receive(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        return type(err).__name__, time.monotonic() - start
    return "received", time.monotonic() - start


def test_receive_without_push_times_out_and_a_new_group_works(members):
    timeout_s = 1.0
    kind, elapsed = members.run(_no_push_body, 2, timeout_s)[1]
    assert kind != "received"
    assert elapsed < timeout_s + 5
    # The members build the next generation of the group on the same store.
    assert members.run(_transfer_dtype_body, 3)[2] == (5, [])


FROZEN = {"embed.weight", "layers.0.norm.weight", "lm_head.weight"}


def _frozen_body(rank, rdzv, broadcast_all, declining_rank):
    """The policy's view of `rollout.broadcast_all_params`: frozen names are sent on the first
    push only, unless every parameter is pushed every time."""
    group = build_group(rdzv, rank=rank, backend="gloo", timeout=TIMEOUT)
    frozen = set() if broadcast_all else FROZEN
    if rank == 0:
        sender = WeightSender(
            group, _state_dict(0), bucket_bytes=BUCKET_BYTES, checksum="always", frozen=frozen
        )
        sent = []
        for version in (1, 2, 3):
            params = _state_dict(version)  # every tensor changes, also the frozen ones
            sent.append(sender.push(params, version).wait().num_bytes)
        sender.close()
        result = (sender.shared_memory, sent, sender.layout.num_bytes)
    else:
        receiver = WeightReceiver(
            group, _state_dict(0), bucket_bytes=BUCKET_BYTES, shared_memory=rank != declining_rank
        )
        model = {k: torch.zeros_like(v) for k, v in _state_dict(0).items()}  # the rollout's copy
        pushes = []
        for _ in range(3):
            version, received = receiver.receive()
            for name, tensor in received.items():
                model[name].copy_(tensor)
            pushes.append(
                (
                    version,
                    sorted(received),
                    {k: torch.equal(v, _state_dict(version)[k]) for k, v in model.items()},
                    {k: torch.equal(v, _state_dict(1)[k]) for k, v in model.items()},
                )
            )
        result = (receiver.shared_memory, pushes)
    group.close()
    return result


@pytest.mark.parametrize("declining_rank", [-1, 2], ids=["shared-memory", "broadcast"])
@pytest.mark.parametrize("broadcast_all", [False, True], ids=["trainable-only", "all-params"])
def test_frozen_tensors_are_sent_on_the_first_push_only(members, broadcast_all, declining_rank):
    reports = members.run(_frozen_body, 3, broadcast_all, declining_rank)
    shared, sent, full_bytes = reports[0]
    assert shared == (declining_rank == -1)
    everything = sorted(_state_dict(0))
    for rank in (1, 2):
        assert reports[rank][0] == shared
        for version, names, now, first in reports[rank][1]:
            if version == 1 or broadcast_all:  # all of it arrives bit-exact
                assert names == everything
                assert all(now.values()), now
            else:  # only the trainable tensors travel; the frozen ones keep the first push's values
                assert names == sorted(set(everything) - FROZEN)
                assert all(now[k] for k in names)
                assert all(first[k] and not now[k] for k in FROZEN), (now, first)
    assert sent[0] == full_bytes
    if broadcast_all:
        assert sent == [full_bytes] * 3
    else:
        assert sent[1] == sent[2] < full_bytes / 2  # lm_head and embed are most of the bytes


ELASTIC_TIMEOUT = timedelta(seconds=5)


def _trained(version: int) -> dict[str, torch.Tensor]:
    """`_state_dict(version)` as a policy holds it: the tensors outside FROZEN train."""
    return {
        name: t.requires_grad_(name not in FROZEN and t.is_floating_point())
        for name, t in _state_dict(version).items()
    }


def _elastic_body(rank, redis_url, job, fault):
    """policy-0 (rank 0: an ElasticSender) pushes versions 1 and 2 to rollout-0 (rank 1: an
    ElasticReceiver, or with fault "peer_left" a receiver that leaves before the push); `fault`
    injects an error into `make_sender` or `apply` ("all_params": none, but every tensor is
    pushed every time). Reports what each side raised or received."""
    state = JobState(connect(redis_url), job)
    pushes = 1 if fault in ("apply", "make_sender", "peer_left") else 2
    if rank == 0:

        def make_sender(group, num_senders):
            if fault == "make_sender":
                raise RuntimeError("injected bug in make_sender")
            return ShardedSender(group, _trained(0), num_senders=num_senders)

        sender = ElasticSender(
            state,
            "policy-0",
            make_sender=make_sender,
            all_params=fault == "all_params",
            timeout=ELASTIC_TIMEOUT,
        )
        try:
            sender.refresh(lambda: _trained(1), 1)
            if pushes == 2:
                sender.push(_trained(2), 2)
            while sender._busy():
                time.sleep(0.05)
            sender.refresh(lambda: _trained(1), 1)  # looks at the finished push
            outcome = ("ok", sender.sender is not None)
        except Exception as err:  # the injected fault must come out here, with its traceback
            outcome = ("raised", f"{type(err).__name__}: {err}")
        sender._leave()
        return outcome
    if fault == "peer_left":
        generation = Generation.from_record(state.group_record("weights"))
        group = build_group(generation.rendezvous(state.redis), rank=1, timeout=ELASTIC_TIMEOUT)
        ShardedReceiver(group, _state_dict(0), _full_boxes(_state_dict(0)), num_senders=1)
        leave_group(group)  # gone before the push
        return ("left", None)
    received = []
    tensors = _state_dict(0)

    def apply(receive):
        if fault == "apply":
            raise RuntimeError("injected out of memory in apply")
        version = receive()
        received.append(
            (
                version,
                sorted(k for k, v in _state_dict(version).items() if torch.equal(tensors[k], v)),
            )
        )

    receiver = ElasticReceiver(
        state,
        "rollout-0",
        make_receiver=lambda group, num_senders: ShardedReceiver(
            group, tensors, _full_boxes(tensors), num_senders=num_senders
        ),
        apply=apply,
        timeout=ELASTIC_TIMEOUT,
    )
    deadline = time.monotonic() + 30
    try:
        while len(received) < pushes and time.monotonic() < deadline:
            if state.regroup_requested("weights") >= 0:
                break  # (the group broke: a new generation would follow in a job)
            receiver.follow()
            time.sleep(0.05)
        outcome = ("ok", received)
    except Exception as err:
        outcome = ("raised", f"{type(err).__name__}: {err}")
    receiver._leave()
    return outcome


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with start_redis(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.mark.parametrize("fault", ["none", "all_params", "apply", "make_sender", "peer_left"])
def test_only_collective_failures_regroup_the_weight_group(members, redis_url, fault):
    """A lost peer makes the weight group be rebuilt; a fault of the replica itself (a bug, an
    out-of-memory error in `make_sender` or `apply`) propagates instead of passing for one.
    Tensors that do not train travel on a generation's first push only, unless every tensor is
    pushed (`rollout.broadcast_all_params`)."""
    job = f"elastic-{fault.replace('_', '-')}"
    state = JobState(connect(redis_url), job)
    record = state.publish_group(
        "weights", ["policy-0", "rollout-0"], ids={"policy-0": 1, "rollout-0": 2}
    )
    sender, receiver = (
        r for _, r in sorted(members.run_on([0, 1], _elastic_body, redis_url, job, fault).items())
    )
    regrouped = state.regroup_requested("weights") == record["generation"]
    everything = sorted(_state_dict(0))
    if fault in ("none", "all_params"):
        second = everything if fault == "all_params" else sorted(set(everything) - FROZEN)
        assert sender == ("ok", True) and receiver == ("ok", [(1, everything), (2, second)])
        assert not regrouped
    elif fault == "apply":
        # the receiver fails (its replica would end) before taking the push, which breaks the
        # push: the sender, not the faulty receiver, asks for a generation without it
        assert receiver == ("raised", "RuntimeError: injected out of memory in apply")
        assert sender == ("ok", False) and regrouped
    elif fault == "make_sender":
        assert sender == ("raised", "RuntimeError: injected bug in make_sender")
    else:  # the receiver left: the push fails on a gloo error, which asks for a new generation
        assert sender == ("ok", False) and regrouped


def test_collective_failures_are_told_from_other_errors():
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    for err in (
        RuntimeError(gloo),
        TimeoutError("no peer"),
        torch.distributed.DistNetworkError("store gone"),
        transport.CorruptedPushError("checksum"),
    ):
        assert is_collective_failure(err), err
    for err in (
        RuntimeError("CUDA out of memory"),
        torch.OutOfMemoryError("CUDA out of memory"),
        ValueError("bug"),
        LayoutMismatchError("layouts differ"),
        KeyError("x"),
    ):
        assert not is_collective_failure(err), err


def test_layout_is_deterministic_and_order_independent():
    state = _state_dict(0)
    layout = BucketLayout.build(state, bucket_bytes=BUCKET_BYTES)
    shuffled = BucketLayout.build(list(reversed(state.items())), bucket_bytes=BUCKET_BYTES)
    assert layout == shuffled
    assert BucketLayout.build(state, bucket_bytes=2 * BUCKET_BYTES).digest != layout.digest
    bf16 = BucketLayout.build(state, transfer_dtype=torch.bfloat16)
    assert set(bf16.bucket_dtypes) == {torch.bfloat16, torch.int64}
    for numel, dtype in zip(layout.bucket_numels, layout.bucket_dtypes, strict=True):
        assert (numel * dtype.itemsize) % 8 == 0
        assert numel * dtype.itemsize <= BUCKET_BYTES or numel == 2000  # lm_head alone
    buffers, views = layout.allocate(torch.device("cpu"))
    assert sum(b.numel() for b in buffers) == sum(layout.bucket_numels)
    assert all(views[k].shape == v.shape and views[k].dtype == v.dtype for k, v in state.items())
    with pytest.raises(ValueError, match="appears twice"):
        BucketLayout.build([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    # Frozen tensors go after the others, in buckets of their own.
    frozen = BucketLayout.build(state, bucket_bytes=BUCKET_BYTES, frozen=FROZEN)
    first = min(s.bucket for s in frozen.slots if s.frozen)
    assert first == frozen.num_trainable_buckets < len(frozen.bucket_numels)
    assert all(s.frozen == (s.bucket >= first) for s in frozen.slots)
    assert frozen.digest != layout.digest
    assert layout.num_trainable_buckets == len(layout.bucket_numels)
    with pytest.raises(ValueError, match="not among the tensors"):
        BucketLayout.build(state, frozen={"nope"})


def _gpu_body(rank, rdzv):
    torch.cuda.set_device(rank)
    group = build_group(rdzv, rank=rank, backend="nccl", timeout=TIMEOUT)
    state = {k: v.cuda() for k, v in _state_dict(7).items()}
    if rank == 0:
        sender = WeightSender(group, state, bucket_bytes=BUCKET_BYTES)
        handle = sender.push(state, 7)
        for t in state.values():
            t.add_(1000)
        handle.wait()
        sender.close()
        result = None
    else:
        version, received = WeightReceiver(group, state, bucket_bytes=BUCKET_BYTES).receive()
        result = (version, all(torch.equal(received[k], v) for k, v in state.items()))
    group.close()
    return result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_push_between_processes(members):
    world_size = min(torch.cuda.device_count(), 2)  # NCCL needs one device per rank
    reports = members.run(_gpu_body, world_size)
    if world_size == 2:
        assert reports[1] == (7, True)


def test_the_weight_group_is_gloo_where_policy_and_rollout_share_a_gpu():
    """NCCL refuses two ranks on one GPU, so mode = "colocated_separated" moves weights over gloo
    (CPU buckets); elsewhere GPUs use NCCL and CPUs gloo."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert weight_backend("disaggregated", gpu) == "nccl"
    assert weight_backend("colocated_separated", gpu) == "gloo"
    assert weight_backend("disaggregated", cpu) == weight_backend("colocated_separated", cpu)
    assert weight_backend("colocated_separated", cpu) == "gloo"


def _colocated_body(rank, rdzv, device_name):
    """mode = "colocated_separated": policy (rank 0) and rollout (rank 1) on one device, a gloo
    group of CPU (shared-memory) buckets; the weights live on `device_name`. A full-weight push
    (`WeightSender` -> `receive_into`), then three resharding pushes into a zero-copy
    `ShardedReceiver`, as a rollout replica builds it. Returns what each rank saw."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both processes on the same GPU
    backend = weight_backend("colocated_separated", device)
    group = build_group(rdzv, rank=rank, backend=backend, timeout=TIMEOUT)

    def on_device(version):
        return {k: v.to(device) for k, v in _state_dict(version).items()}

    if rank == 0:
        state = on_device(7)
        sender = WeightSender(group, state, bucket_bytes=BUCKET_BYTES)
        handle = sender.push(state, 7)
        for t in state.values():  # the next step changes the parameters at once
            t.add_(1000)
        handle.wait()
        sender.close()
        sharded = ShardedSender(group, on_device(0), num_senders=1, bucket_bytes=BUCKET_BYTES)
        for version in (8, 9, 10):
            params = on_device(version)
            sharded.push(params, version)
            for t in params.values():
                t.add_(1000)
        sharded.close()
        result = (backend, sender.shared_memory, sharded.shared_memory, sharded.zero_copy)
    else:
        own = {k: torch.zeros_like(v) for k, v in on_device(0).items()}
        receiver = WeightReceiver(group, own, bucket_bytes=BUCKET_BYTES)
        version = receiver.receive_into(own)
        pushed = [(version, _exact(own, version), receiver.shared_memory)]
        params = on_device(0)
        pointers = {k: t.data_ptr() for k, t in params.items()}
        sharded = ShardedReceiver(
            group,
            params,
            _full_boxes(params),
            num_senders=1,
            bucket_bytes=BUCKET_BYTES,
            zero_copy=True,
        )
        for _ in range(3):
            version = sharded.receive()
            pushed.append((version, _exact(params, version), sharded.shared_memory))
        sharded.close()
        moved = {k for k, t in params.items() if t.data_ptr() != pointers[k]}
        devices = {str(t.device) for t in params.values()}
        result = (pushed, sharded.zero_copy, moved == set(params), devices)
    group.close()
    return result


def _exact(tensors, version):
    """Whether `tensors` hold `_state_dict(version)` bit for bit, in its dtypes."""
    expected = _state_dict(version)
    return sorted(tensors) == sorted(expected) and all(
        tensors[k].dtype == v.dtype and torch.equal(tensors[k].cpu(), v)
        for k, v in expected.items()
    )


def _check_colocated(reports, device_name):
    cuda = device_name.startswith("cuda")
    assert reports[0] == ("gloo", True, True, not cuda)
    pushed, zero_copy, re_pointed, devices = reports[1]
    assert pushed == [(7, True, True), (8, True, True), (9, True, True), (10, True, True)]
    # GPU parameters cannot be views of the CPU set: they take copies in place; CPU ones are
    # re-pointed at it (zero-copy)
    assert (zero_copy, re_pointed) == (not cuda, not cuda)
    assert devices == {str(torch.device(device_name))}


def test_colocated_weights_go_through_shared_memory_on_cpu(members):
    """The same code as the GPU test below, with the weights on the CPU."""
    _check_colocated(members.run(_colocated_body, 2, "cpu"), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_colocated_push_between_processes_on_one_gpu(members):
    """Policy and rollout processes on the same GPU (mode = "colocated_separated"): a gloo group
    stages CUDA weights through host shared memory and they arrive bit for bit, in the
    rollout's GPU parameters (copied in place, not re-pointed at the CPU set)."""
    _check_colocated(members.run(_colocated_body, 2, "cuda:0"), "cuda:0")


def test_gloo_address_is_the_one_that_reaches_the_rendezvous(monkeypatch):
    """On one host the group listens on loopback only; a rendezvous elsewhere gets the local
    address that routes to it, which peers on other hosts can reach (tests/test_multinode.py
    runs a job across namespaces); GLOO_SOCKET_IFNAME leaves the choice to gloo."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_address(Rendezvous("127.0.0.1", 29500, "g", 2)) == "127.0.0.1"
    one_host = Rendezvous("", 0, "g", 2, redis=connect("redis://127.0.0.1:1/0"))
    assert gloo_address(one_host) == "127.0.0.1"
    remote = Rendezvous("192.0.2.77", 29500, "g", 2)  # (TEST-NET-1: never reached)
    address = gloo_address(remote)  # (None on a machine with no route to it)
    assert address is None or not address.startswith("127.")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert gloo_address(remote) is None


def test_a_member_that_gives_up_joining_takes_its_peers_with_it(redis_url):
    """Joining a weight group is settled once for all members: a member that gives up (its
    generation was replaced) after it announced itself makes a peer that arrives later give
    up too, at once, instead of building the group without it until the timeout (the stall
    behind docs/world-models.md's known weakness: a second rollout replica joining while the
    first generation was being built)."""
    from nebula_rl.weights.group import GroupCancelled

    redis = connect(redis_url)
    rdzv = Rendezvous("", 0, "joining-given-up", 2, redis=redis)
    with pytest.raises(GroupCancelled, match="a newer generation replaced it"):
        build_group(rdzv, rank=1, timeout=timedelta(seconds=30), cancelled=lambda: True)
    start = time.monotonic()
    with pytest.raises(GroupCancelled, match="a peer gave up joining it"):
        build_group(rdzv, rank=0, timeout=timedelta(seconds=30), cancelled=lambda: False)
    assert time.monotonic() - start < 5


def test_a_member_that_would_give_up_after_all_joined_builds_the_group(redis_url):
    """Once every member announced itself and one saw it, the group goes ahead: a member whose
    generation is replaced only then still builds it with its peers (it leaves afterwards), so
    none waits for it in the backend's setup."""
    import threading

    redis = connect(redis_url)
    rdzv = Rendezvous("", 0, "joining-decided", 2, redis=redis)
    late = time.monotonic() + 0.2  # (rank 1 first asks at 0.5 s: after rank 0 saw both)
    built: dict[int, object] = {}

    def join(rank: int, cancelled) -> None:
        group = build_group(rdzv, rank=rank, timeout=timedelta(seconds=30), cancelled=cancelled)
        data = torch.tensor([7.0 if rank == 0 else 0.0])
        group.pg.broadcast(data, 0).wait()
        built[rank] = float(data)
        leave_group(group)

    waiter = threading.Thread(target=join, args=(1, lambda: time.monotonic() > late))
    waiter.start()
    join(0, lambda: False)
    waiter.join(timeout=30)
    assert built == {0: 7.0, 1: 7.0}


def test_a_shared_weights_file_is_read_back_by_another_mapping_and_leaves_nothing_behind():
    """`SharedWeights` (how a vLLM engine hands an update to its tensor-parallel workers): a
    second mapping of the file, as a worker process makes, reads each tensor as written (also
    after a later write into the same file); unlinked, the file is gone from the folder while
    the mappings keep working."""
    from nebula_rl.rollout.shared_weights import SharedWeights, mapped_tensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=gen),
        "b.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c.weight": torch.randint(0, 9, (2, 3, 4), generator=gen),
    }
    segment = SharedWeights((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    segment.write(tensors.items())
    assert all(offset % 64 == 0 for _, offset, _, _ in segment.manifest)
    reader = dict(mapped_tensors(segment.path, segment.manifest))
    assert reader.keys() == tensors.keys()
    assert all(torch.equal(reader[n], t) and reader[n].dtype == t.dtype for n, t in tensors.items())
    path = Path(segment.path)
    segment.unlink()
    assert not path.exists()
    segment.write([("a.weight", tensors["a.weight"] * 2)])  # (an update after the unlink)
    assert torch.equal(reader["a.weight"], tensors["a.weight"] * 2)
    segment.close()
    assert torch.equal(reader["b.bias"], tensors["b.bias"])  # (the reader's mapping lives on)
