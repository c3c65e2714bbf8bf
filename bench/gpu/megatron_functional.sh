#!/usr/bin/env bash
# Megatron-LM's own test tooling on this package, one H200: its functional-test cases
# (tests/functional_tests/test_cases/moe, judged by Megatron's extractor and
# test_pretraining_regular_pipeline.py) and HybridModel from pretrain_hybrid.py
# (bench/gpu/megatron_functional.py says what each does).
#   bash bench/gpu/megatron_functional.sh functional [CASE ...]   # source /tmp/te_env.sh first for
#                                  # gpt_moe_flex_hybridep_dropless_te (TE + .gpu/hybridep; else it is skipped)
#   bash bench/gpu/megatron_functional.sh functional --dry-run [CASE ...]  # list the cases; any machine
#   bash bench/gpu/megatron_functional.sh hybrid                  # after `source /tmp/te_env.sh`
#   bash bench/gpu/megatron_functional.sh unit_tests              # TE optional (its tests skip without)
# Needs (repository root as cwd, never committed): .gpu/megatron-lm/ (Megatron-LM core_r0.19.0:
# pretrain_gpt.py, pretrain_hybrid.py, gpt_builders.py, hybrid_builders.py, model_provider.py,
# megatron/core/datasets/Makefile, tests/functional_tests/{python_test_utils,shell_test_utils},
# tests/unit_tests/{conftest.py,test_utilities.py,transformer/moe/{conftest.py,test_token_dispatcher.py,
# test_moe_layer.py},dist_checkpointing/{__init__,utils}.py} with their __init__.py files,
# tests/test_utils/python_scripts/download_unit_tests_dataset.py, MEGATRON_LM_COMMIT), the
# megatron-core wheel in .whl/ and, for Megatron's python_test_utils (pydantic is not in the GPU
# image), .whl/functional/ (pydantic 2.12.5, pydantic-core 2.41.5, annotated-types 0.7.0,
# typing-inspection 0.4.2). Writes $OUT/megatron_<what>.json and $OUT/megatron_<what>/.
set -uo pipefail
cd "$(dirname "$0")/../.."
# A dry run lists the cases and their commands and runs nothing: no set-up, no GPU.
for arg in "$@"; do [ "$arg" = --dry-run ] && exec "${PYTHON:-python3}" bench/gpu/megatron_functional.py "$@"; done
export OUT="${OUT:-./outputs}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
source bench/gpu/megatron_lm_env.sh  # PY, MLM, megatron-core and its datasets Makefile
if [ "${1:-}" = functional ] && ! $PY -c "import pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_functional \
    .whl/functional/*.whl && export PYTHONPATH="/tmp/site_functional${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY bench/gpu/megatron_functional.py "$@"
