"""What splitting a diffusers transformer for context parallelism costs besides its collectives.

`flow.context_parallel` splits a Cosmos-Predict2.5 or Wan transformer with forward hooks and
Cosmos 3's generator through its own seams, and runs each block's self-attention under a
torch-function mode. This times one process's forward and backward of each tiny preset
(`--frames` frames of `--size` pixels, batch 2; Cosmos 3's: latents of 2 frames of 8 x 8 and two
captions' tokens) three ways, in the same run, 1 thread:

- plain: the model as loaded (the peer);
- split, gathers off: `context_parallel` over a 1-rank gloo group with the gathers replaced by
  the identity, so what remains is the hooks and the mode (their Python cost per call);
- split: the same with its gathers, which on one rank are gloo calls that move nothing (what a
  collective's fixed cost is here, not what a real split costs: that depends on the link).

Printed: milliseconds per forward + backward (best of 5 rounds of `--iters`) and the ratio to
plain. The tiny presets are two blocks of width 64, so the fixed costs weigh the most here.

    python bench/flow_cp_overhead.py [--frames 4] [--size 16] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import nebula_rl.flow.context_parallel as cp
import nebula_rl.utils.sequence_split as sequence_split
from nebula_rl.flow.diffusers_models import tiny_diffusers_flow_model
from nebula_rl.weights import free_port

PRESETS = ("tiny:cosmos_transformer3d", "tiny:wan_transformer3d", "tiny:cosmos3_omni_generator")


def _seconds(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], iters: int) -> float:
    for _ in range(3):
        model(*inputs).sum().backward()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            model(*inputs).sum().backward()
        rounds.append((time.perf_counter() - start) / iters)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    gather = cp.gather_shares
    for preset in PRESETS:
        generator = torch.Generator().manual_seed(0)
        plain = tiny_diffusers_flow_model(preset, frames=args.frames, size=args.size, text_dim=32)
        split = tiny_diffusers_flow_model(preset, frames=args.frames, size=args.size, text_dim=32)
        inputs = (
            torch.randn(2, 3, args.frames, args.size, args.size, generator=generator),
            torch.rand(2, generator=generator),
            torch.randn(2, 8, 32, generator=generator),
            torch.ones(2, 8),
        )
        if plain.kind == "Cosmos3OmniTransformer":  # (latents; its captions' token ids)
            text = plain.text_encoder(["a red square", "a blue bar on the left"])
            latents = torch.randn(2, 4, 2, 8, 8, generator=generator)
            inputs = (latents, inputs[1], text, (text[..., 0] > 0).float())
        split.context_parallel(dist.group.WORLD)
        for module in (cp, sequence_split):  # (the hooks' gathers and the mode's)
            module.gather_shares = lambda share, group, dim=1: share  # type: ignore[assignment]
        hooks_only = _seconds(split, inputs, args.iters)
        cp.gather_shares = sequence_split.gather_shares = gather
        peer = _seconds(plain, inputs, args.iters)
        with_gathers = _seconds(split, inputs, args.iters)
        peer = min(peer, _seconds(plain, inputs, args.iters))
        print(
            f"{preset}: plain {1e3 * peer:.2f} ms; split, gathers off {1e3 * hooks_only:.2f} ms "
            f"({hooks_only / peer:.3f}x); split {1e3 * with_gathers:.2f} ms "
            f"({with_gathers / peer:.3f}x)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
