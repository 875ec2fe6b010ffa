#!/usr/bin/env bash
# One short GPU lease, end to end: install from a wheelhouse over the machine's CUDA torch,
# then bench/gpu.py's phases, each under its own time budget, so one that fails or runs
# long leaves the others their time. Results and logs go to $OUT (default bench/results/lease).
#
#   bash bench/gpu_lease.sh [WHEELS_DIR]     # on the GPU machine; ~10 minutes at most
#
# The wheelhouse is made where there is internet (docs/installing.md):
#   bash setup.sh --download-wheels wheels --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --have FREEZE
set -u
OUT=${OUT:-bench/results/lease}
WHEELS=${1:-wheels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the lent H100/H200 image keeps its CUDA torch in a venv, not on the default PATH
[[ -x /opt/torch/.venv/bin/python3 ]] && export PATH=/opt/torch/.venv/bin:$PATH
rm -rf .venv  # a fresh install over that torch: one left from another machine is wrong
phase() {  # NAME SECONDS COMMAND...: run under a hard limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/phases.txt"
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  >"$OUT/phases.txt" 2>&1
phase setup 100 env TORCH_VERSION=system bash setup.sh --wheelhouse "$WHEELS"
py=.venv/bin/python
phase throughput 200 $py bench/gpu.py --out "$OUT/gpu.json" --time-limit 150 \
  --option plain --option fused --max-micro-batch 64
phase overhead 90 $py bench/gpu.py --overhead --profile 3 --out "$OUT/gpu_overhead.json" \
  --time-limit 60 --attentions softmax belief_star
# the causal runs to compare with: llama-188m plain in the throughput phase, same machine
phase documents 90 $py bench/gpu.py --out "$OUT/gpu_documents.json" --time-limit 60 \
  --models llama-188m --attentions softmax belief_star --option documents \
  --max-micro-batch 64 --check-steps 5
phase gpu_tests 120 $py -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/
cat "$OUT/phases.txt"
