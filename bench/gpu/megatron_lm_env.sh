# Sourced by the scripts that run Megatron-LM's own entry points (repository root as cwd):
# sets PY and MLM (default .gpu/megatron-lm, carried, never committed), installs megatron-core from the
# carried wheel where it does not import, and gives the installed megatron/core/datasets the
# Makefile that pretrain's start-up `make` wants and the wheel lacks (the compiled helpers are in
# the wheel: touch them so make has nothing to do), and puts apex's fused_weight_gradient_mlp_cuda
# on PYTHONPATH where ../shared/tools/apex-on-device built it (Megatron's gradient-accumulation fusion).
PY="${PYTHON:-python3}"
MLM="${MLM:-$PWD/.gpu/megatron-lm}"
[ -f "$MLM/pretrain_gpt.py" ] || { echo "missing $MLM/pretrain_gpt.py (carry .gpu/megatron-lm)"; exit 2; }
$PY -c "import megatron.core" 2>/dev/null || $PY -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
DATASETS=$($PY -c "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))")
cp "$MLM/megatron/core/datasets/Makefile" "$DATASETS/Makefile" && touch "$DATASETS"/helpers_cpp*.so
if [ -e /tmp/apexbuild/fused_weight_gradient_mlp_cuda.so ]; then
  export PYTHONPATH="/tmp/apexbuild${PYTHONPATH:+:$PYTHONPATH}"
fi
