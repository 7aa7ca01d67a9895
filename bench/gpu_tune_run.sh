#!/usr/bin/env bash
# Tune the shipped GPU workloads on a real GPU and compare with what triton.autotune
# and cudnn.benchmark pick. Writes everything under $1 (default ./gpu-run).
# Usage: bench/gpu_tune_run.sh OUTDIR [BUDGET_S] [gemm|conv|all]
set -uo pipefail
out=${1:-gpu-run}
budget=${2:-40}
what=${3:-all}
mkdir -p "$out"
case "$what" in
  gemm) workloads=(gemm-bf16-8192 gemm-bf16-4096x4096x16384) ;;
  conv) workloads=(conv-l4-report conv-fp16-channels-last) ;;
  *) workloads=(gemm-bf16-8192 gemm-bf16-4096x4096x16384 conv-l4-report conv-fp16-channels-last) ;;
esac
args=()
for w in "${workloads[@]}"; do args+=(--workload "$w"); done
python3 -m gpuwatchd tune --backend nvml --budget "$budget" --store "$out/gpu.db" \
  --poll-interval 0.1 "${args[@]}" 2>&1 | tee "$out/tune-$what.log"
python3 -m gpuwatchd report --store "$out/gpu.db" --format json > "$out/report.json"
python3 -m gpuwatchd report --store "$out/gpu.db" > "$out/report.txt"
python3 -m gpuwatchd report --store "$out/gpu.db" --format json > "$out/report-$what.json"
if [ "$what" != conv ]; then
  python3 - "$out" <<'PY'
import json, sys
from gpuwatchd.tuning.worker.families.triton_matmul import triton_autotune_pick
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS
picks = {}
for w in DEFAULT_WORKLOADS:
    if w.name.startswith("gemm-"):
        p = triton_autotune_pick(w)
        p.pop("triton_config", None)
        picks[w.name] = p
        print("triton.autotune pick", w.name, p["name"])
json.dump(picks, open(sys.argv[1] + "/autotune.json", "w"), indent=1, default=str)
PY
fi
