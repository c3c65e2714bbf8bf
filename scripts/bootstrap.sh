#!/usr/bin/env bash
# Create (once) and update (when requirements change) the project's Python 3.12 venv in .venv.
# Idempotent: a stamp file records the hash of everything that decides the install.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && \
       "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

stamp=.venv/.megatron_moe_ext_stamp
want=$(cat pyproject.toml requirements/*.txt scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  py=$(find_python312) || { echo "bootstrap: python3.12 not found (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
  echo "bootstrap: creating .venv with $py"
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c requirements/constraints.txt \
  -r requirements/test.txt torch triton megatron-core numpy
.venv/bin/python -m pip install -q -c requirements/constraints.txt --no-deps -e .
echo "$want" > "$stamp"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null))"
