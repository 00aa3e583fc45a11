#!/usr/bin/env bash
# The world-model demo on one GPU (issue 17; BENCHMARKS.md, "World-model RL on the GPU"), in one
# call: a random-init diffusers CosmosTransformer3DModel at Cosmos-Predict2.5-2B's width and depth
# (bench/gpu/make_cosmos.py), a flow-matching warm start on the toy videos
# (configs/wfm/gpu_cosmos_sft.toml), then FlowGRPO and DDRL from that warm start with the
# brightness reward scored by `nebula-rl reward-service` (configs/wfm/gpu_cosmos_*.toml), all in
# bf16 mixed precision; prints SUMMARY lines. Run from the repository root with the project's
# packages importable (the .whl/ wheels on the device machine, see BENCHMARKS.md):
#   OUT=/some/dir bash bench/gpu/wfm_session.sh
# (PY: the python; MODEL_ARGS: make_cosmos.py's size flags, e.g. for a CPU smoke run
#  "--layers 2 --heads 2 --head-dim 32"; SFT_STEPS, RL_STEPS: fewer steps.)
set -u
OUT=${OUT:-outputs/gpu_wfm}
PY=${PY:-python3}
WORK=/tmp/nebula-gpu
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
rm -rf "$WORK/wfm" "$WORK/cosmos2b"

timed() {  # timed NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how long
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $? in $((SECONDS - start)) s"
}

if command -v nvidia-smi > /dev/null; then  # (the GPU's used memory, every second)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 > "$WORK/mem.csv" &
  WATCHER=$!
fi
timed make_model 90 $PY bench/gpu/make_cosmos.py --out "$WORK/cosmos2b" ${MODEL_ARGS:-}
cat "$OUT/make_model.log"
timed sft ${SFT_LIMIT:-150} $PY -m nebula_rl.cli train --local --config configs/wfm/gpu_cosmos_sft.toml \
  ${SFT_STEPS:+--max-num-steps $SFT_STEPS}

# The reward service, as users run it: its own process, a token, HTTP on loopback.
PORT=$($PY -c "from nebula_rl.weights import free_port; print(free_port())")
TOKEN=$($PY -c "import secrets; print(secrets.token_urlsafe(24))")
printf 'host = "127.0.0.1"\nport = %s\n\n[[reward_args]]\nreward_type = "brightness"\n' "$PORT" \
  > "$WORK/rewards.toml"
NEBULA_REWARD_TOKEN=$TOKEN $PY -m nebula_rl.cli reward-service --config "$WORK/rewards.toml" \
  > "$OUT/reward_service.log" 2>&1 &
SERVICE=$!
export REMOTE_REWARD_TOKEN=$TOKEN
export REMOTE_REWARD_ENQUEUE_URL=http://127.0.0.1:$PORT/api/reward/enqueue
export REMOTE_REWARD_FETCH_URL=http://127.0.0.1:$PORT/api/reward/pull
for algo in flow_grpo ddrl; do
  timed $algo ${RL_LIMIT:-170} $PY -m nebula_rl.cli train --local --config configs/wfm/gpu_cosmos_$algo.toml \
    ${RL_STEPS:+--max-num-steps $RL_STEPS}
done
kill $SERVICE 2>/dev/null
wait $SERVICE 2>/dev/null

for run in warmstart flow_grpo ddrl; do
  cp "$WORK/wfm/$run/metrics.jsonl" "$OUT/metrics_$run.jsonl" 2>/dev/null
done
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in ("warmstart", "flow_grpo", "ddrl"):
    path = out / f"metrics_{run}.jsonl"
    if not path.exists():
        print(f"SUMMARY {run}: no metrics")
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    n = max(1, min(20, len(rows) // 2))
    def mean(part, key):
        values = [r[key] for r in part if key in r]
        return sum(values) / len(values) if values else float("nan")
    if run == "warmstart":
        print(f"SUMMARY warmstart: {len(rows)} steps, loss {mean(rows[:n], 'loss'):.4f} -> {mean(rows[-n:], 'loss'):.4f}")
        continue
    print(
        f"SUMMARY {run}: {len(rows)} iterations; reward (first {n} -> last {n}) "
        f"{mean(rows[:n], 'reward_mean'):.3f} -> {mean(rows[-n:], 'reward_mean'):.3f}; data distance "
        f"{mean(rows[:n], 'data_distance'):.3f} -> {mean(rows[-n:], 'data_distance'):.3f}; "
        f"rewards lost {sum(r.get('rewards_lost', 0) for r in rows):.0f}"
    )
PY
if [ -n "${WATCHER:-}" ]; then
  kill $WATCHER
  echo "SUMMARY GPU memory used, peak over the session: $(sort -n "$WORK/mem.csv" | tail -1) MiB"
fi
grep -h "Traceback\|Error" "$OUT"/*.log | head -20
