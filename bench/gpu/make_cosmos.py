"""Write a random-init diffusers `CosmosTransformer3DModel` folder with Cosmos-Predict2.5-2B's
width and depth (16 heads x 128 = 2048 wide, 28 blocks, MLP ratio 4, AdaLN-LoRA 256, a
cross-attention projection into 1024-wide text features), taking pixels (3 channels, no VAE) and
the toy dataset's 32-wide text embeddings, for the world-model demo on a GPU
(`bench/gpu/wfm_session.sh`). `--layers/--heads/--head-dim` shrink it for a CPU smoke run.

    python bench/gpu/make_cosmos.py --out /tmp/cosmos2b --frames 2 --size 32
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--frames", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--text-dim", type=int, default=32, help="the dataset's embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from diffusers import CosmosTransformer3DModel

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # (random init on the GPU: seconds instead of a minute)
        model = CosmosTransformer3DModel(
            in_channels=3,
            out_channels=3,
            num_attention_heads=args.heads,
            attention_head_dim=args.head_dim,
            num_layers=args.layers,
            mlp_ratio=4.0,
            text_embed_dim=1024,
            adaln_lora_dim=256,
            max_size=(max(args.frames, 2), args.size, args.size),
            patch_size=(1, 2, 2),
            concat_padding_mask=False,
            extra_pos_embed_type=None,
            use_crossattn_projection=True,
            crossattn_proj_in_channels=args.text_dim,
            encoder_hidden_states_channels=1024,
        )
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"CosmosTransformer3DModel: {params / 1e9:.2f}B parameters, "
        f"{args.heads}x{args.head_dim} wide, {args.layers} blocks -> {args.out} "
        f"({time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
