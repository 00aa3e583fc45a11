"""The reward service (`nebula-rl reward-service`): scores generated images and videos (world
models) or completions' text (language models) over HTTP for a trainer, in cosmos-rl's
reward-service protocol, with the rewards of :mod:`nebula_rl.rewards.visual`, the registered text
rewards of :mod:`nebula_rl.rewards` (`gsm8k`, `arithmetic`, ...), or any `module.path:function`
of either signature.

A trainer enqueues a batch (`POST /api/reward/enqueue`, body `<JSON>\\n<npy bytes>`; for text,
`media_type = "text"` with the completions and references in the JSON and nothing after the
newline) and gets a uuid at once; worker processes score it; the trainer pulls each reward's
scores by uuid and name (`POST /api/reward/pull`, form fields `uuid` and `type`; 400 until they
are ready). Every endpoint but `/health` needs `Authorization: Bearer <token>`.

Inside: a bounded queue (`max_pending` tasks waiting or running; 429 beyond it, never a silent
drop), one shared pool of `num_workers` spawned processes that run any of the configured rewards,
batching of queued requests of the same reward and sample shape (text: of the same reward) into
one call, and a supervisor thread that puts the tasks of a worker that died back at the front of
the queue and starts a new worker. Results stay in this process's memory for `result_ttl_s`.
The code: `config` (the TOML file and the token), `wire` (paths and requests), `pool` (queue,
batching, worker processes), `app` (HTTP and start-up). See docs/reward-service.md.
"""

from nebula_rl.rewards.service.app import (
    RunningService,
    bind_socket,
    create_app,
    run_service,
    start_service,
)
from nebula_rl.rewards.service.config import (
    TOKEN_ENV,
    RewardArgs,
    RewardServiceConfig,
    load_service_config,
    resolve_reward,
    resolve_token,
    service_config_from_dict,
)
from nebula_rl.rewards.service.pool import RewardService
from nebula_rl.rewards.service.wire import (
    ENQUEUE_PATH,
    MEDIA_TYPES,
    PING_PATH,
    PULL_PATH,
    EnqueueRequest,
    RequestError,
    TextSamples,
    parse_enqueue,
)

__all__ = [
    "ENQUEUE_PATH",
    "MEDIA_TYPES",
    "PING_PATH",
    "PULL_PATH",
    "TOKEN_ENV",
    "EnqueueRequest",
    "RequestError",
    "RewardArgs",
    "RewardService",
    "RewardServiceConfig",
    "RunningService",
    "TextSamples",
    "bind_socket",
    "create_app",
    "load_service_config",
    "parse_enqueue",
    "resolve_reward",
    "resolve_token",
    "run_service",
    "service_config_from_dict",
    "start_service",
]
