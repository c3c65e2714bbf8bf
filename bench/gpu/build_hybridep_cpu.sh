#!/usr/bin/env bash
# Builds DeepEP's `hybrid_ep_cpp` extension on the CPU machine (no GPU, no driver) and assembles
# .gpu/hybridep/ as bench/gpu/HYBRIDEP.md describes; about 4.5 minutes on two free cores.
#   git -C <DeepEP clone> archive 94a9f8f | tar x -C .gpu/deepep-src   # the sources, ignored
#   bash bench/gpu/build_hybridep_cpu.sh
# The extension links -lcuda: a stub libcuda.so (soname libcuda.so.1, every cu* name of the
# toolkit's cuda.h as an empty function) stands in at link time; the GPU machine's driver
# library is the one loaded at run time. Nothing of DeepEP is committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD SRC=$PWD/.gpu/deepep-src OUTD=$PWD/.gpu/hybridep
PY=${PYTHON:-$ROOT/.venv/bin/python}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-2}
SP=$($PY -c "import sysconfig; print(sysconfig.get_path('purelib'))")
[ -f "$SRC/setup.py" ] || { echo "no DeepEP sources in $SRC"; exit 2; }
mkdir -p "$SRC/stub"
grep -ohE '\bcu[A-Z][A-Za-z0-9_]*' "$CUDA_HOME/include/cuda.h" | sort -u \
  | awk '{print "int "$1"(void){return 0;}"}' > "$SRC/stub/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$SRC/stub/libcuda.so" "$SRC/stub/cuda_stub.c"
export CPATH=$SP/nvidia/cu13/include:$CUDA_HOME/include:$CUDA_HOME/include/cccl
export LIBRARY_PATH=$SRC/stub:$CUDA_HOME/lib
# Only get_extension_hybrid_ep_cpp() of DeepEP's setup.py (importing it runs no setup()).
(cd "$SRC" && $PY - <<'PYEOF'
import sys, setuptools
sys.path.insert(0, ".")
from torch.utils.cpp_extension import BuildExtension
import setup as deepep_setup
setuptools.setup(name="hybrid_ep_only", ext_modules=[deepep_setup.get_extension_hybrid_ep_cpp()],
                 cmdclass={"build_ext": BuildExtension}, script_args=["build_ext", "--inplace"])
PYEOF
)
rm -rf "$OUTD" && mkdir -p "$OUTD/deep_ep"
cp "$SRC"/hybrid_ep_cpp*.so "$OUTD/"
cp "$SRC/deep_ep/hybrid_ep_buffer.py" "$OUTD/deep_ep/"
echo 'from .hybrid_ep_buffer import HybridEPBuffer' > "$OUTD/deep_ep/__init__.py"
cp -r "$SRC/deep_ep/backend" "$OUTD/deep_ep/backend"
# The sources come from `git archive`, without history: the commit is the one archived.
echo "${DEEPEP_COMMIT:-94a9f8f6b146c07d97ec58f67cd6d303296d6098}" > "$OUTD/DEEPEP_COMMIT"
du -sh "$OUTD"
