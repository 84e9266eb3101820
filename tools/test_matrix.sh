#!/usr/bin/env bash
# The real-model tests under settings that change the CPU numerics (issue 9): the default,
# f32 and bf16 inference precision (through $OVROUTER_OV_CONFIG, which every model server
# merges under a model's own ov_config), and oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that take
# effect on this machine. Before each run, one line of proof: the ISA oneDNN reports and the
# precision the CPU plugin compiles with. Usage: tools/test_matrix.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

settings=(
  "default|"
  "f32|OVROUTER_OV_CONFIG={\"INFERENCE_PRECISION_HINT\":\"f32\"}"
  "bf16|OVROUTER_OV_CONFIG={\"INFERENCE_PRECISION_HINT\":\"bf16\"}"
  "no-AMX (AVX-512 BF16 kernels)|ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
  "AVX-512 f32 (a Xeon without BF16)|ONEDNN_MAX_CPU_ISA=AVX512_CORE OVROUTER_OV_CONFIG={\"INFERENCE_PRECISION_HINT\":\"f32\"}"
)
failed=()
for entry in "${settings[@]}"; do
  name=${entry%%|*}; vars=${entry#*|}
  echo "=== matrix: $name ${vars:+($vars)}"
  # shellcheck disable=SC2086
  env $vars ONEDNN_VERBOSE=1 $PY tools/matrix_probe.py 2>&1 | grep -E "isa:|compiled" | sed 's/^/    /'
  # shellcheck disable=SC2086
  if ! env $vars $PY -m pytest -m real_model -q -p no:cacheprovider "$@"; then failed+=("$name"); fi
done
if ((${#failed[@]})); then echo "matrix FAILED under: ${failed[*]}"; exit 1; fi
echo "matrix passed under all ${#settings[@]} settings"
