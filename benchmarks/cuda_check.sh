#!/usr/bin/env bash
# The model-level tests on a CUDA GPU, with the assertions they have on CPU (the `device` fixture in
# tests/conftest.py reads INFINIGEN_TEST_DEVICE), plus the CUDA-only tests (no host sync in the decode loop).
# Run from the repository root on a machine with a CUDA GPU; the source tree is imported (PYTHONPATH=src):
#     OUT=results/gpu bash benchmarks/cuda_check.sh            # writes cuda_tests.xml and device.txt there
#     bash benchmarks/cuda_check.sh -k offload                 # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" INFINIGEN_TEST_DEVICE=cuda PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  "$PYTHON" -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', t.__version__, torch.cuda.get_device_name())"
} | tee "$OUT/device.txt"
timeout -s INT -k 15 "${TESTS_TIMEOUT:-600}" "$PYTHON" -m pytest -q -p no:cacheprovider --timeout 120 -rfEs \
  --tb=short --durations=10 -m "not integration" --junitxml "$OUT/cuda_tests.xml" \
  tests/runtime/test_exactness.py tests/policies/test_policies.py tests/placement/test_offload.py \
  tests/runtime/test_int4_kernels.py tests/policies/test_spec_packed.py tests/runtime/test_fused_select_triton.py \
  tests/policies/test_remainder.py tests/placement/test_offload_correction.py tests/runtime/test_teacher_rows.py "$@"
