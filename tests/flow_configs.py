"""The small world-model configs the tests build: `tiny_flow_policy` is the `[policy]` table (a
flow model of `frames` frames of `size` x `size` pixels, sampled in `steps` steps),
`tiny_flow_train_policy` its `[train.train_policy]` table on the toy clips, `tiny_flow_config`
the whole config of such an RL run; `reward_service` starts the reward service such a run is
pointed at by `scored_remotely`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def tiny_flow_policy(
    model: str = "tiny:dit", *, frames: int = 2, size: int = 8, steps: int = 4, **diffusers: Any
) -> dict[str, Any]:
    """`policy` of a world-model config: `model_name_or_path = model`, `is_diffusers`, and
    `[policy.diffusers]` with the given shape and sampler steps (and `diffusers`' extra keys)."""
    return {
        "model_name_or_path": model,
        "is_diffusers": True,
        "diffusers": {
            "is_video": frames > 1,
            "inference_size": [size, size],
            "inference_frames": frames,
            "train_frames": frames,
            "sample": {"num_steps": steps, "eval_num_steps": steps},
            **diffusers,
        },
    }


def tiny_flow_config(
    output_dir: Any,
    policy: dict[str, Any],
    *,
    trainer: str = "flow_grpo",
    max_num_steps: int = 3,
    clip: float = 1e-3,
    timestamp: str | None = None,
    **train_policy: Any,
) -> dict[str, Any]:
    """A world-model RL config (as a dict) of `policy` on the toy clips (two per prompt, scored
    by brightness, 4 samples per prompt, 8 per step in passes of 4), with `trainer`'s loss
    clipped at `clip` on both sides, and `train_policy`'s extra keys."""
    train: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_num_steps": max_num_steps,
        "train_batch_per_replica": 8,
        "optm_lr": 1e-3,
        "train_policy": tiny_flow_train_policy(trainer, clip=clip, **train_policy),
    }
    if timestamp is not None:
        train["timestamp"] = timestamp
    return {"train": train, "rollout": {"n_generation": 4}, "policy": policy}


def tiny_flow_train_policy(
    trainer: str = "flow_grpo",
    *,
    clip: float = 1e-3,
    mini_batch: int = 4,
    clips_per_prompt: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """`train.train_policy` of a world-model RL config: `trainer` on the toy clips
    (`clips_per_prompt` per prompt) scored by brightness, its loss clipped at `clip` on both
    sides, passes of `mini_batch` rows, and `extra` keys."""
    return {
        "type": "grpo",
        "trainer_type": trainer,
        "reward_function": "brightness",
        "mini_batch": mini_batch,
        "epsilon_low": clip,
        "epsilon_high": clip,
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": clips_per_prompt}},
        **extra,
    }


@contextmanager
def reward_service(monkeypatch: Any, reward_type: str) -> Iterator[Any]:
    """The reward service scoring with `reward_type`, started here on a free port, and the
    `REMOTE_REWARD_*` variables a world-model run reads set to reach it (token included)."""
    from nebula_rl.rewards.service import service_config_from_dict, start_service
    from nebula_rl.weights import free_port

    config = service_config_from_dict(
        {"port": free_port(), "reward_args": [{"reward_type": reward_type}]}
    )
    with start_service(config, token="secret-token") as service:
        base = f"{service.url}/api/reward"
        monkeypatch.setenv("REMOTE_REWARD_TOKEN", "secret-token")
        monkeypatch.setenv("REMOTE_REWARD_ENQUEUE_URL", f"{base}/enqueue")
        monkeypatch.setenv("REMOTE_REWARD_FETCH_URL", f"{base}/pull")
        yield service


def scored_remotely(cfg: dict[str, Any], name: str, *, weight: float, batch_size: int) -> None:
    """Make the world-model config `cfg` (a dict, changed in place) score through the reward
    service with the function `name` at `weight`, in requests of `batch_size` samples."""
    policy = cfg["train"]["train_policy"]
    policy["use_remote_reward"] = True
    del policy["reward_function"]
    policy["remote_reward"] = {
        "batch_size": batch_size,
        "reward_fns": [{"name": name, "weight": weight}],
    }


def tiny_text_pipeline(folder: Any, *, kind: str = "wan", frames: int = 5, size: int = 8) -> Any:
    """Write a tiny pipeline with its text encoders into `folder` (returned): `kind` "wan" is
    `tiny:wan_transformer3d_latent`'s transformer and VAE for `frames` frames of `size` x `size`
    pixels with a 2-layer UMT5 32 wide; "sd3" is `tiny:sd3_transformer2d_latent`'s (one frame)
    with two CLIP encoders (16 wide, their pooled vectors 16 + 16) and a T5 32 wide; "cosmos" is
    `tiny:cosmos_transformer3d_latent`'s with a 2-layer Qwen2.5-VL 32 wide, its transformer
    projecting the 2 x 32 states to 32 (`use_crossattn_projection`, as Cosmos-Predict2.5's);
    "sana" is `tiny:sana_transformer2d_latent`'s (one frame, a DC-AE) with a 2-layer Gemma 2 32
    wide; "sana_video" `tiny:sana_video_transformer3d_latent`'s (Wan's VAE) with that Gemma 2. Every tokenizer is the presets' byte-level one (CLIP's cut at 24 tokens)."""
    import json
    from pathlib import Path

    import diffusers
    import transformers

    from nebula_rl.flow.diffusers_models import save_diffusers_flow_model, tiny_diffusers_flow_model
    from nebula_rl.models import build_char_tokenizer

    folder = Path(folder)
    preset = {
        "wan": "tiny:wan_transformer3d_latent",
        "sd3": "tiny:sd3_transformer2d_latent",
        "cosmos": "tiny:cosmos_transformer3d_latent",
        "sana": "tiny:sana_transformer2d_latent",
        "sana_video": "tiny:sana_video_transformer3d_latent",
    }[kind]
    frames = 1 if kind in ("sd3", "sana") else frames
    model = tiny_diffusers_flow_model(preset, frames=frames, size=size, text_dim=32)
    tokenizer = build_char_tokenizer()
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    t5 = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 2, **ids}
    parts: dict[str, Any] = {}
    if kind == "wan":
        parts["text_encoder"] = transformers.UMT5EncoderModel(
            transformers.UMT5Config(vocab_size=len(tokenizer), **t5)
        )
    elif kind == "sd3":
        clip = transformers.CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, projection_dim=16, max_position_embeddings=24,
            bos_token_id=tokenizer.eos_token_id, **ids,
        )  # fmt: skip
        parts["text_encoder"] = transformers.CLIPTextModelWithProjection(clip)
        parts["text_encoder_2"] = transformers.CLIPTextModelWithProjection(clip)
        parts["text_encoder_3"] = transformers.T5EncoderModel(
            transformers.T5Config(vocab_size=len(tokenizer), **t5)
        )
    elif kind in ("sana", "sana_video"):
        parts["text_encoder"] = transformers.Gemma2Model(
            transformers.Gemma2Config(
                vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                bos_token_id=tokenizer.eos_token_id, **ids,
            )
        )  # fmt: skip
    else:
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]}
        qwen = transformers.Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                "max_position_embeddings": 1024, "rope_parameters": rope,
                "bos_token_id": tokenizer.eos_token_id, **ids,
            },
            vision_config={
                "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "out_hidden_size": 32, "fullatt_block_indexes": [0],
            },
        )  # fmt: skip
        parts["text_encoder"] = transformers.Qwen2_5_VLForConditionalGeneration(qwen)
        config = {k: v for k, v in model.transformer.config.items() if not k.startswith("_")}
        config.update(use_crossattn_projection=True, crossattn_proj_in_channels=2 * 32)
        model.transformer = diffusers.CosmosTransformer3DModel(**config)
    save_diffusers_flow_model(model, folder)
    index = json.loads((folder / "model_index.json").read_text())
    for name, encoder in parts.items():
        encoder.save_pretrained(folder / name)
        tokenizer.model_max_length = 24 if "CLIP" in type(encoder).__name__ else 512
        tokenizer.save_pretrained(folder / name.replace("text_encoder", "tokenizer"))
        index[name] = ["transformers", type(encoder).__name__]
        index[name.replace("text_encoder", "tokenizer")] = [
            "transformers",
            "PreTrainedTokenizerFast",
        ]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder
