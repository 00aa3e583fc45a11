#!/usr/bin/env bash
# Everything issue 21 measures on one lent GPU, in one call (BENCHMARKS.md, "On the GPU"):
#   1. the gpu-marked tests (tests/test_gpu.py and the others marked gpu), with their GPU-REPORT
#      lines;
#   2. bench/gpu_engine.py: the engine against HF generate and the HBM bound (bf16 and FP8);
#   3. configs/gpu_gsm8k.toml as a job: controller, a policy replica and a rollout replica on the
#      one GPU (mode = "colocated_separated"), with the GPU's memory sampled;
#   4. the same job with --local (one process taking turns).
# Each stage has its own time limit and log; the summary prints last. Run from the repository root
# on the device machine with the wheels of .whl/ (see BENCHMARKS.md) installed first:
#   OUT=/some/dir bash bench/gpu_session.sh [stages, default "tests engine job local"]
# (PY: the python; CONFIG: the job's config; JOB_STEPS: its steps, default the config's.)
set -u
OUT=${OUT:-outputs/gpu_session}
mkdir -p "$OUT"
STAGES=${*:-tests engine job local}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
CONFIG=${CONFIG:-configs/gpu_gsm8k.toml}  # (a smaller one for a CPU smoke run of this script)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  $PY -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
} 2>&1
# (at most 8 files come back from the device machine: the memory samples stay in $SCRATCH)
SCRATCH=${SCRATCH:-/tmp/gpu_session}
mkdir -p "$SCRATCH"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== stage $name: rc $rc in $((SECONDS - start)) s"
}

mem_watch() {  # sample the GPU's used memory (MiB) every 0.5 s into $1 until killed
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$1" 2>/dev/null
}

for s in $STAGES; do
  case $s in
    tests)
      stage tests 130 $PY -m pytest -q -s -m gpu -p no:cacheprovider \
        tests/test_gpu.py tests/test_engine.py tests/test_weights.py tests/test_parallelize.py
      ;;
    engine)
      stage engine 90 $PY bench/gpu_engine.py --quantization fp8 --json "$OUT/engine.json"
      ;;
    job)
      mem_watch "$SCRATCH/job_mem.csv" & watcher=$!
      stage job 130 $PY -m nebula_rl.cli train --config "$CONFIG" \
        --output-dir /tmp/gpu_job --timestamp run ${JOB_STEPS:+--max-num-steps $JOB_STEPS}
      kill $watcher 2>/dev/null
      cp /tmp/gpu_job/run/metrics.jsonl "$OUT/job_metrics.jsonl" 2>/dev/null
      (cd /tmp/gpu_job/run && tar czf - logs) > "$OUT/job_logs.tgz" 2>/dev/null
      ;;
    local)
      grep -v '^mode = ' "$CONFIG" > /tmp/gpu_local.toml
      mem_watch "$SCRATCH/local_mem.csv" & watcher=$!
      stage local 70 $PY -m nebula_rl.cli train --config /tmp/gpu_local.toml --local \
        --output-dir /tmp/gpu_local --timestamp run --max-num-steps 4
      kill $watcher 2>/dev/null
      cp /tmp/gpu_local/run/metrics.jsonl "$OUT/local_metrics.jsonl" 2>/dev/null
      ;;
  esac
done

echo "== summary"
grep -h "GPU-REPORT\|passed\|failed\|SKIPPED\|Error" "$OUT/tests.log" 2>/dev/null | tail -40
grep -h "SUMMARY\|^row\|^hf_generate\|^engine\|^device\|^model\|^workload\|^measured" \
  "$OUT/engine.log" 2>/dev/null
$PY bench/gpu/job_summary.py "$OUT" /tmp/gpu_job/run/logs "$SCRATCH"
