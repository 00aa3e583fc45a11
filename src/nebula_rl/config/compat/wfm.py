"""cosmos-rl's `--wfm-mode` configs, read key by key.

The world-model schema of its cosmos-predict2-5 GRPO/DDRL recipes: `[model.rl]`, `[trainer]`,
`[optimizer]`, `[dataloader_train]`, ...

Each key either becomes the nebula-rl key that does the same (`model.rl.num_rollout` ->
`rollout.n_generation`, `model.rl.guidance = g` -> `policy.diffusers.sample.guidance_scale =
g`, `model.rl.train_on` -> `policy.diffusers.train_on`, `model.rl.update_ref_every_iter` ->
`train.train_policy.reference_reset_interval`, `model.rl.use_same_seed` ->
`policy.diffusers.sample.same_group_noise`, `kl_beta` and `clip_ratio` with cosmos-rl's
squared-error KL and log-ratio (`policy.diffusers.kl_form` / `ratio_form = "squared_error"`) and
per-group advantages, ...), or is named with the reason nebula-rl cannot
honour it (cosmos-rl's own Cosmos-Predict2.5 network, VAE and `.pt` checkpoints; its training
callbacks). Its rewards (`model.rl.reward_config`: by default the reward service's
`dance_grpo` scores, taking `overall_reward`) become `use_remote_reward` with that
`score_key`. So cosmos-rl's shipped configs (their own network) do not run as they are:
loading one names every key that differs, and :func:`translate_wfm` gives the nebula-rl config
the rest of its keys describe, a start for the port. One whose model is a `[policy]` table
(`model_name_or_path`: a diffusers folder or Hub id) and whose other keys all translate runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nebula_rl.config.base import ConfigError

__all__ = ["WFM_TABLES", "check_wfm", "is_wfm", "translate_wfm"]

WFM_TABLES = {"trainer", "model_parallel", "dataloader_train", "checkpoint", "optimizer"}
"""Top-level tables only the world-model schema has."""

_NETWORK = (
    "cosmos-rl's own Cosmos-Predict2.5 network (its DiT, Wan2.1 VAE, text encoders and .pt "
    "checkpoints) is not run by nebula-rl, which trains diffusers transformers (with their "
    "pipeline's VAE in latent space): set policy.model_name_or_path (docs/world-models.md)"
)
_HOOK = (
    "cosmos-rl's training callbacks (speed, memory, S3 uploads, preview samples); nebula-rl logs "
    "through [logging] instead: drop them"
)


def is_wfm(data: dict[str, Any]) -> bool:
    """Whether `data` is a config of cosmos-rl's world-model schema."""
    return "train" not in data and bool(WFM_TABLES & data.keys())


def _set(out: dict[str, Any], dotted: str, value: Any) -> None:
    node = out
    *path, last = dotted.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


_REMOTE: dict[str, Any] = {
    "enabled": True, "score_key": "overall_reward", "scale": 1.0, "reward_fn": "dance_grpo",
    "reward_clip_min": -5.0, "reward_clip_max": 5.0, "token": "", "enqueue_url": "",
    "fetch_url": "",
}  # fmt: skip
"""cosmos-rl's `model.rl.reward_config.remote_reward` defaults."""


Refuse = Callable[[str, Any, str], None]
"""Records a key that cannot be honoured: (key, value, why)."""


def _rewards(config: dict[str, Any], out: dict[str, Any], refuse: Refuse) -> None:
    """`model.rl.reward_config`: its remote reward (on by default: `dance_grpo`'s
    `overall_reward` from the reward service, clipped, then scaled) becomes
    `use_remote_reward` with one `reward_fns` entry; the in-process reward models are refused."""
    remote = _REMOTE | dict(config.pop("remote_reward", {}))
    for key in ("token", "enqueue_url", "fetch_url"):
        if remote.pop(key):
            variable = f"REMOTE_REWARD_{key.upper()}"
            refuse(
                f"model.rl.reward_config.remote_reward.{key}", "...",
                f"nebula-rl reads it from the environment: set {variable} (or WFM_REWARD_* "
                "as cosmos-rl's launcher does)",
            )  # fmt: skip
    low, high = float(config.pop("adv_clip_min", -5.0)), float(config.pop("adv_clip_max", 5.0))
    if (low, high) != (-5.0, 5.0):
        refuse(
            "model.rl.reward_config.adv_clip_min/max", [low, high],
            "nebula-rl clips world-model advantages to [-5, 5]",
        )  # fmt: skip
    config.pop("ALL_REWARD_MODELS", None)
    for name in ("aesthetic", "image_reward", "fake_reward"):
        if dict(config.pop(name, {})).get("enabled", False):
            refuse(
                f"model.rl.reward_config.{name}.enabled", True,
                "cosmos-rl's in-process reward models are not built; score through the reward "
                "service (nebula-rl reward-service runs any reward function by import path)",
            )  # fmt: skip
    for key, value in config.items():
        refuse(f"model.rl.reward_config.{key}", value, "not read by nebula-rl")
    for key in remote.keys() - _REMOTE.keys():
        refuse(f"model.rl.reward_config.remote_reward.{key}", remote[key], "not read by nebula-rl")
    if not remote["enabled"]:
        refuse(
            "model.rl.reward_config.remote_reward.enabled", False,
            "no reward is left: world-model RL needs one",
        )  # fmt: skip
        return
    scale, low, high = (float(remote[k]) for k in ("scale", "reward_clip_min", "reward_clip_max"))
    reward = {
        "name": str(remote["reward_fn"]), "weight": 1.0, "score_key": str(remote["score_key"]),
        "clip_min": low, "clip_max": high,
    }  # fmt: skip
    _set(out, "train.train_policy.use_remote_reward", True)
    _set(
        out,
        "train.train_policy.remote_reward",
        {  # (clipped, then scaled: the total's own clip is then no bound)
            "scale": scale,
            "reward_fns": [reward],
            "reward_clip_min": min(low * scale, high * scale),
            "reward_clip_max": max(low * scale, high * scale),
        },
    )


def translate_wfm(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the nebula-rl config the keys of `data` ask for, one line per key it cannot honour:
    `<key> = <value>: <why>`)."""
    out: dict[str, Any] = {"policy": {"is_diffusers": True}}
    problems: list[str] = []

    def refuse(key: str, value: Any, why: str) -> None:
        problems.append(f"{key} = {value!r} (--wfm-mode schema): {why}")

    model = dict(data.get("model", {}))
    rl = dict(model.pop("rl", {}))
    _rl_keys(rl, out, refuse)
    _model_keys(data, model, out, problems)
    _training_keys(data, out, problems, refuse)
    return out, problems


def _rl_keys(rl: dict[str, Any], out: dict[str, Any], refuse: Refuse) -> None:
    """`[model.rl]`: the RL algorithm, its sampler and its rewards."""
    steps = int(rl.pop("sample_steps", 10))
    _set(out, "policy.diffusers.sample.num_steps", steps)
    _set(out, "rollout.n_generation", int(rl.pop("num_rollout", 8)))
    data_beta = float(rl.pop("data_beta", 0.0))
    _set(out, "train.train_policy.type", "grpo")
    _set(out, "train.train_policy.trainer_type", "ddrl" if data_beta > 0 else "flow_grpo")
    _set(out, "train.train_policy.data_beta", data_beta)
    kl_beta = float(rl.pop("kl_beta", 0.01))
    _set(out, "train.train_policy.kl_beta", kl_beta)
    clip = float(rl.pop("clip_ratio", 1e-4))
    _set(out, "train.train_policy.epsilon_low", clip)
    _set(out, "train.train_policy.epsilon_high", clip)
    # cosmos-rl's objective, so that kl_beta and clip_ratio weigh what they weigh there: its
    # log-ratio and KL are squared errors without the Gaussian's 1 / (2 sigma^2), and its
    # advantages are normalised within each prompt's group (torch's n - 1 std)
    _set(out, "policy.diffusers.ratio_form", "squared_error")
    _set(out, "policy.diffusers.kl_form", "squared_error")
    _set(out, "policy.diffusers.sample.global_std", False)
    guidance = float(rl.pop("guidance", 0.0))  # (cosmos-rl's network: v_c + g (v_c - v_u))
    if 0.0 < guidance <= 1.0:
        refuse(
            "model.rl.guidance", guidance,
            "a Cosmos-Predict2.5 transformer reads guidance_scale as its diffusers pipeline "
            "does, guiding as v_c + g (v_c - v_u) only when g > 1",
        )  # fmt: skip
    _set(out, "policy.diffusers.sample.guidance_scale", guidance if guidance > 1.0 else 1.0)
    train_on = [int(i) for i in rl.pop("train_on", list(range(8)))]
    _set(out, "policy.diffusers.train_on", train_on)  # (-1: a step drawn per iteration, alike)
    refresh = int(rl.pop("update_ref_every_iter", 16))
    if kl_beta > 0 and refresh > 0:  # (cosmos-rl copies the weights, the optimiser goes on)
        _set(out, "train.train_policy.reference_reset_interval", refresh)
        _set(out, "train.train_policy.reset_optimizer_with_reference", False)
    # (cosmos-rl's defaults: 1..1, image-to-video; its DDRL recipes 0..1, mixing in text-to-video)
    most = int(rl.pop("max_num_conditional_frames", 1))
    fewest = min(int(rl.pop("min_num_conditional_frames", 1)), most)  # (max 0: none given)
    _set(out, "policy.diffusers.min_num_conditional_frames", fewest)
    _set(out, "policy.diffusers.max_num_conditional_frames", most)
    # (a seed shared by the group's ranks: their starting noise; the SDE's noise is each rank's)
    _set(out, "policy.diffusers.sample.same_group_noise", bool(rl.pop("use_same_seed", True)))
    _rewards(dict(rl.pop("reward_config", {})), out, refuse)
    rl.pop("enabled", None)
    rl.pop("on_policy", None)
    for key, value in rl.items():
        refuse(f"model.rl.{key}", value, "not read by nebula-rl")


def _model_keys(
    data: dict[str, Any], model: dict[str, Any], out: dict[str, Any], problems: list[str]
) -> None:
    """The model (a diffusers model from `[policy]`) and its parallel layout."""
    # The schema's model is cosmos-rl's own network; a diffusers model comes from [policy].
    named = [f"model.{k}" for k in ("net", "tokenizer", "text_encoder_config") if k in model]
    named += ["checkpoint.load_path"] if "load_path" in data.get("checkpoint", {}) else []
    policy = data.get("policy", {})
    if named:
        problems.append(f"{', '.join(named)} (--wfm-mode schema): {_NETWORK}")
    elif "model_name_or_path" not in policy:
        problems.append(f"model (--wfm-mode schema): {_NETWORK}")
    for key, value in policy.items():
        _set(out, f"policy.{key}", value)
    if "fsdp_shard_size" in model:
        _set(out, "policy.parallelism.dp_shard_size", int(model["fsdp_shard_size"]))
    if "dp_replicate_size" in model:  # (HSDP: copies of the fsdp_shard_size shards)
        _set(out, "policy.parallelism.dp_replicate_size", int(model["dp_replicate_size"]))
    if "context_parallel_size" in data.get("model_parallel", {}):  # (the built-in DiT's)
        cp = int(data["model_parallel"]["context_parallel_size"])
        _set(out, "policy.parallelism.cp_size", cp)


def _training_keys(
    data: dict[str, Any], out: dict[str, Any], problems: list[str], refuse: Refuse
) -> None:
    """The optimiser, schedule, trainer callbacks, dataset and logging."""
    optimizer = data.get("optimizer", {})
    if "lr" in optimizer:
        _set(out, "train.optm_lr", float(optimizer["lr"]))
    if "weight_decay" in optimizer:
        _set(out, "train.optm_weight_decay", float(optimizer["weight_decay"]))
    warm = data.get("scheduler", {}).get("warm_up_steps")
    if warm:
        _set(out, "train.optm_warmup_steps", int(warm[0]))
    trainer = data.get("trainer", {})
    _set(out, "train.max_num_steps", int(trainer.get("max_iter", 25)))
    hooks = []
    for callback in trainer.get("callbacks", []):
        name = callback.get("name")
        if name == "grad_clip":
            norm = callback.get("args", {}).get("clip_norm", 1.0)
            _set(out, "train.optm_grad_norm_clip", float(norm))
        elif name in ("wandb", "wandb_10x"):  # (W&B logging: nebula-rl's own sink)
            _set(out, "logging.logger", ["console", "wandb"])
        else:
            hooks.append(str(callback.get("name")))
    if hooks:
        problems.append(f"trainer.callbacks {', '.join(hooks)} (--wfm-mode schema): {_HOOK}")

    loader = data.get("dataloader_train", {})
    videos = loader.get("video_dataloader", {})
    if loader.get("type", "local") != "local":
        refuse(
            "dataloader_train.type",
            loader.get("type"),
            "nebula-rl reads cosmos-rl's local video layout (metas/, videos/, t5_xxl/)",
        )
    elif "dataset_dir" in videos:
        _set(out, "train.train_policy.dataset.name", str(videos["dataset_dir"]))
    if "num_frames" in videos:
        count = int(videos["num_frames"])
        _set(out, "policy.diffusers.inference_frames", count)
        _set(out, "policy.diffusers.train_frames", count)
    if "video_size" in videos:
        width, height = videos["video_size"]
        _set(out, "policy.diffusers.inference_size", [int(height), int(width)])

    job = data.get("job", {})
    for ours, theirs in (
        ("logging.project_name", "project"),
        ("logging.group_name", "group"),
        ("logging.experiment_name", "name"),
        ("logging.wandb_mode", "wandb_mode"),
    ):
        if theirs in job:
            _set(out, ours, job[theirs])


def check_wfm(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data`, or for a cosmos-rl `--wfm-mode` config the nebula-rl config its keys translate
    to (:func:`translate_wfm`); raises naming each key that cannot be honoured."""
    if not is_wfm(data):
        return data
    translated, problems = translate_wfm(data)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return translated
