"""Weight sync between two parallel layouts: each policy rank sends each rollout rank only the
slices that rank needs, and nobody gathers the whole model.

The members of one `WeightGroup` are every rank of the policy (group ranks `0..P-1`, the
senders) and every rank of one rollout replica (`P..P+R-1`, the receivers). Each member describes
what it holds (policy) or needs (rollout) as one box per tensor: the `(start, stop)` range of the
full tensor along every dimension. The policy derives its boxes from DTensor placements (FSDP2,
HSDP, TP, any composition: the same offsets torch.distributed.checkpoint uses), or the full box
for a plain tensor; the rollout from its engine's tensor-parallel layout (`TorchEngine.tp_boxes`).

Building a `ShardedSender` / `ShardedReceiver` is a collective: the members all-gather their
boxes (as JSON) and each computes the same plan from them:

1. For every rollout rank and tensor, intersect its box with each distinct policy box. Ranks that
   hold the same box (data-parallel replicas) take turns by receiving rank, so replicas share
   the sending. The intersections must tile the needed box exactly, or building fails.
2. Pieces from one sender to one receiver are packed, in name order, into messages of at most
   `bucket_bytes` (a larger piece is split by rows). Messages are ordered round-robin over the
   (sender, receiver) pairs, so all pairs transfer at once.
3. A push runs that one global order with point-to-point `send`/`recv`, at most `window`
   messages in flight per member. Every member follows the same order and waits only on its
   oldest message, so the earliest unfinished message always has both ends posted: no deadlock.

Same host, gloo (on CPU, or GPUs that policy and rollout share: `mode = "colocated_separated"`,
`group.weight_backend`): the pieces go through shared memory instead of step 3, as
`transport.py`'s full-weight push does. Building negotiates it (`shared.share`: all members
must read a random token in rank 0's files, or everyone uses send/recv) and maps two persistent
sets, each laid out like the rollout ranks' own tensors (`_shared_layout`): one block per
receiver storage, so the parts of a fused tensor (q/k/v, gate/up) sit consecutively as in the
engine; receivers whose blocks are identical (a tensor every TP rank keeps whole, the same TP
rank of two replicas) share one, written once. A push then:

1. `ShardedSender.push` (caller's thread, at a step boundary) copies this rank's pieces from
   its live shards into the receivers' places in the push's set (one copy, with the dtype
   cast), sends every rollout rank a header (version, trainable_only, checksum?, set, the
   checksum of what that rank reads from this one) point to point, and returns a `PushHandle`:
   the caller may change its parameters at once. No weights cross the group.
2. A background thread waits for the rollout ranks' acknowledgements.
3. `ShardedReceiver.receive` takes the headers of all policy ranks, checks that they agree and
   verifies the checksums when asked. A zero-copy receiver (`zero_copy=True`, what a rollout
   replica uses, with its tensors on the CPU) then re-points its tensors at their places in the
   set: the policy's copy was the only one. Otherwise (also GPU tensors, which a CPU set cannot
   hold) it copies its pieces from the set into its tensors (a second copy). The policy's copy
   into the set reads its shards where they live, GPU or CPU.
   It acknowledges (success or failure) to every policy rank; the handle is done when every
   rollout rank acknowledged, and a failure raises on both sides.

Sets alternate push by push: push k writes set k % 2 only after every rollout rank
acknowledged push k - 2, the last one in that set, so a copying receiver reading push k never
sees push k + 1 (the other set) or k + 2 (not written before it acknowledged k) being written:
at most two pushes are in flight. With a zero-copy receiver in the group, a set holds the
weights a receiver generates with until it takes the next push, so push k waits for every
acknowledgement of push k - 1 (one in flight), and the first push into each set (pushes 1 and
2) carries every tensor, frozen ones included. `push` waits for those handles itself. The
plan digests are compared when shared memory is negotiated (a member with another plan
declines it; the send/recv path then raises `LayoutMismatchError` on its first push). Without
shared memory (NCCL on GPUs, another host, a member that declined) `push` keeps the send/recv
path above: it reads the live parameters, so it returns only when its messages are sent (a
finished handle), and receivers write into their tensors in place. That path is unchanged by
shared memory; its NCCL use has not been run (the tests run gloo on CPU).

Memory: with shared memory, two sets in `/dev/shm` shared by the whole group
(`shared_memory_bytes`, the same pages on every member): twice what the rollout ranks hold,
counting each shared block once; about twice the model for a TP rollout (blocks are padded to
64 bytes). Zero-copy receivers keep no weights of their own beyond that: their tensors are the
sets. The files are unlinked once every member mapped them (on failure too), so a dying
process leaves nothing behind; the pages live while a process maps them. Nothing private,
nothing allocated per push. Without: each member reuses `window` buffers of at most one bucket
(plus an 8-byte checksum word) for the whole run, and packs/unpacks straight from/into its own
tensors (`peak_buffer_bytes`).

Trainable parameters only: the first push sends everything; later pushes with
`trainable_only=True` send only the tensors the policy marked trainable (frozen ones cannot have
changed). Checksums: with `checksum="first"` (default) the first push carries the sum of the
bytes of every message (send/recv) or of every piece a rollout rank reads from a policy rank
(shared memory), which the receiver verifies; "always" and "never" do what they say.

Other rollout replicas: rank i of the replica that received the weights holds the same shards as
rank i of every other replica with the same TP size, so it forwards them with `WeightSender`
over a group of those ranks (a broadcast, or shared memory on one host), as
`tests/test_reshard.py` does.
"""

from nebula_rl.weights.reshard.endpoints import ShardedReceiver, ShardedSender
from nebula_rl.weights.reshard.plan import Box, chunk_box, dtensor_box, full_box

__all__ = [
    "Box",
    "ShardedReceiver",
    "ShardedSender",
    "chunk_box",
    "dtensor_box",
    "full_box",
]
