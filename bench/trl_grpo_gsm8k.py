"""nebula-rl against TRL's `GRPOTrainer` on the GSM8K-shaped job: `bench/trl_grpo.py` with
`--config configs/bench_gsm8k.toml --steps 20 --window 10 --name gsm8k` (its SUMMARY lines end in
`_gsm8k`; ~25 min on 2 CPU cores in bf16, half of it TRL's). Arguments given here override those,
e.g. `--steps 6 --window 3` for a quicker look, `--param-dtype float32`."""

from __future__ import annotations

import sys

from trl_grpo import main

if __name__ == "__main__":
    sys.argv[1:1] = ["--config", "configs/bench_gsm8k.toml", "--steps", "20", "--window", "10"]
    sys.argv[1:1] = ["--name", "gsm8k"]
    main()
