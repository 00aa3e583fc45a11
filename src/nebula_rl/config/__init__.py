"""One typed configuration tree, loaded from TOML and validated at load.

The tree is cosmos-rl's (NVIDIA's RL framework, whose configs nebula-rl runs): every section and
key of its schema exists here with its meaning, so a cosmos-rl config loads as it is; keys that
nebula-rl adds say "nebula-rl" in their docstring. One module per section (`training`,
`algorithm`, `policy`, `rollout`, ...), the whole tree in `job`. Loading (`load`) does, in
order: cosmos-rl's compatibility (`compat`: its stale keys read out with a warning, a
`--wfm-mode` config translated, side effects between keys), validation (types, ranges, the
rules between sections), and `refusals` (a key whose feature nebula-rl does not have yet is
refused at any value but its default, naming the key, the value and why).

Unknown keys are errors ("did you mean ..."); errors name the file and the dotted key. Nothing is
parsed and ignored: `tests/test_config_usage.py` fails for a field no code reads.
"""

from __future__ import annotations

from nebula_rl.config.algorithm import (
    VARIANT_DEFAULTS,
    DistillationConfig,
    GrpoConfig,
    SftConfig,
)
from nebula_rl.config.base import ConfigError
from nebula_rl.config.compat.cosmos import STALE_KEYS
from nebula_rl.config.data import VISION_OPTIONS, DatasetConfig
from nebula_rl.config.job import Config, ControllerConfig, VLAConfig
from nebula_rl.config.load import config_from_dict, load_config
from nebula_rl.config.monitoring import LoggingConfig, ProfilerConfig, ValidationConfig
from nebula_rl.config.parallel import ParallelismConfig, RolloutParallelismConfig
from nebula_rl.config.policy import DiffusersConfig, LoraConfig, PolicyConfig
from nebula_rl.config.refusals import refusals
from nebula_rl.config.reward import OverlongRewardConfig, RemoteRewardConfig
from nebula_rl.config.rollout import MultiTurnRolloutConfig, RolloutConfig, SamplingConfig
from nebula_rl.config.training import CheckpointConfig, TrainingConfig
from nebula_rl.config.world import FLOW_RL_TRAINERS

__all__ = [
    "FLOW_RL_TRAINERS",
    "STALE_KEYS",
    "VARIANT_DEFAULTS",
    "VISION_OPTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "DatasetConfig",
    "DiffusersConfig",
    "DistillationConfig",
    "GrpoConfig",
    "LoggingConfig",
    "LoraConfig",
    "MultiTurnRolloutConfig",
    "OverlongRewardConfig",
    "ParallelismConfig",
    "PolicyConfig",
    "ProfilerConfig",
    "RemoteRewardConfig",
    "RolloutConfig",
    "RolloutParallelismConfig",
    "SamplingConfig",
    "SftConfig",
    "TrainingConfig",
    "VLAConfig",
    "ValidationConfig",
    "config_from_dict",
    "load_config",
    "refusals",
]
