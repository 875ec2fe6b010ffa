#!/usr/bin/env bash
# Make (or refresh) the project's virtualenv from nothing: torch first and pinned, then
# megatron-core, DeepSpeed (no op builds, no build isolation) and the project itself.
#
#   bash setup.sh          runtime: train / evaluate / generate
#   bash setup.sh --dev    + test and lint tools
#
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_VERSION (default
# 2.13.0), TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128 on a cluster whose
# default index has the wrong CUDA build). Re-running is a no-op unless this script,
# pyproject.toml or the options changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --dev)" >&2; exit 2 ;;
  esac
done

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

"$PYTHON" - <<'PY' || { echo "setup.sh: Python >= 3.11 is required ($PYTHON)" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 11))
PY

stamp="$VENV/.belief-lm-setup"
want="$(cat setup.sh pyproject.toml | sha256sum | cut -c1-16) dev=$DEV torch=$TORCH_VERSION"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup.sh: $VENV is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

pip_install --upgrade pip setuptools wheel

# 1. torch, pinned and first: anything that asks for an unpinned torch later finds it
#    satisfied instead of pulling the newest (multi-GB CUDA) build.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  pip_install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi

# 2. DeepSpeed: its setup imports torch, so no build isolation (which would fetch another
#    torch); DS_BUILD_OPS=0 skips compiling CUDA/C++ ops (they JIT-build if ever used).
DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed>=0.19,<0.20"

# 3. The project and the rest of its dependencies (megatron-core 0.16.x on Python 3.11).
extras=""
[[ $DEV == 1 ]] && extras="[dev]"
pip_install --no-build-isolation -e ".$extras"

# 4. On a CPU-only machine DeepSpeed JIT-compiles a small shared-memory comm op the first
#    time a process group starts (~30 s); do it once here rather than inside a first run.
if ! "$PY" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
  DS_ACCELERATOR=cpu "$PY" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
    >/dev/null 2>&1 || echo "setup.sh: note: DeepSpeed's CPU comm op did not build (optional)"
fi

"$PY" - <<PY
import torch, megatron.core, deepspeed, sentencepiece
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
print(f"setup.sh: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"deepspeed {deepspeed.__version__}, cuda={torch.cuda.is_available()}")
PY
echo "$want" > "$stamp"
