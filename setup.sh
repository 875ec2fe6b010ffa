#!/usr/bin/env bash
# Make (or refresh) the project's virtualenv from nothing: torch first and pinned, then
# megatron-core, DeepSpeed (no op builds, no build isolation) and the project itself.
#
#   bash setup.sh          runtime: train / evaluate / generate
#   bash setup.sh --dev    + test and lint tools (under CI, also --infra)
#   bash setup.sh --infra  + system packages for tests/infra (SLURM, Docker; root, apt)
#
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_VERSION (default
# 2.13.0; "system": keep the torch that PYTHON already has, as in an NGC PyTorch image),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128 on a cluster whose default
# index has the wrong CUDA build; without it, a Linux machine without nvidia-smi gets the
# CPU build). Re-running is a no-op unless this script,
# pyproject.toml or the options changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEV=0
INFRA=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --infra) INFRA=1 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --dev, --infra)" >&2; exit 2 ;;
  esac
done
# CI runs the infrastructure tests for real, so there --dev brings their packages too.
case "${CI:-}" in "" | 0 | false | no) ;; *) [[ $DEV == 1 ]] && INFRA=1 ;; esac
[[ $INFRA == 1 ]] && bash tests/infra/install.sh

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

venv_options=()
[[ $TORCH_VERSION == system ]] && venv_options=(--system-site-packages)  # to see its torch
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "${venv_options[@]}" "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

pip_install --upgrade pip setuptools wheel

# 1. torch, pinned and first; every later pip call is constrained to it, so a dependency
#    asking for another torch fails instead of pulling a (multi-GB CUDA) build over it.
if [[ $TORCH_VERSION == system ]]; then
  "$PY" -c "import torch" || { echo "setup.sh: TORCH_VERSION=system but $PYTHON has no torch" >&2; exit 1; }
elif ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  if [[ -n ${TORCH_INDEX_URL:-} ]]; then
    pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  elif [[ $(uname -s) == Linux ]] && ! command -v nvidia-smi > /dev/null; then
    # No NVIDIA GPU: PyPI's Linux torch is the multi-GB CUDA build, so ask for the CPU build
    # (from pip's own sources, e.g. a find-links wheel, else PyPI + PyTorch's CPU index) and
    # fall back to PyPI's default build only if neither has it.
    pip_install "torch==$TORCH_VERSION+cpu" 2> /dev/null ||
      pip_install "torch==$TORCH_VERSION+cpu" --timeout 30 --retries 1 \
        --extra-index-url https://download.pytorch.org/whl/cpu ||
      { echo "setup.sh: no CPU build of torch $TORCH_VERSION reachable; installing PyPI's" \
          "default build (with CUDA libraries, several GB)" >&2
        pip_install "torch==$TORCH_VERSION"; }
  else
    pip_install "torch==$TORCH_VERSION"
  fi
fi
# The distribution's version, not torch.__version__: PyPI's CUDA wheel is "2.13.0" while
# its torch.__version__ says "2.13.0+cu130", and a constraint on the latter matches nothing.
"$PY" -c "from importlib.metadata import version; print(f'torch=={version(\"torch\")}')" \
  > "$VENV/torch-constraint.txt"
export PIP_CONSTRAINT="$VENV/torch-constraint.txt"

# 2. DeepSpeed: its setup imports torch, so no build isolation (which would fetch another
#    torch); DS_BUILD_OPS=0 skips compiling CUDA/C++ ops (they JIT-build if ever used).
DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed>=0.19,<0.20"

# 3. The project and the rest of its dependencies (megatron-core 0.16.x on Python 3.11).
extras=""
[[ $DEV == 1 ]] && extras="[dev]"
pip_install --no-build-isolation -e ".$extras"

# 4. On a CPU-only machine DeepSpeed JIT-compiles a small shared-memory comm op the first
#    time a process group starts (~30 s); do it once here rather than inside a first run.
if "$PY" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then  # exit 0: no GPU
  # (its build runs ninja, which DeepSpeed installed into the venv: put that on PATH)
  PATH="$(realpath "$VENV/bin"):$PATH" DS_ACCELERATOR=cpu \
    "$PY" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
    >/dev/null 2>&1 || echo "setup.sh: note: DeepSpeed's CPU comm op did not build (runs retry; needs a C++ compiler)"
fi

"$PY" - <<PY
import torch, megatron.core, deepspeed, sentencepiece
assert "$TORCH_VERSION" in ("system", torch.__version__.split("+")[0]), torch.__version__
print(f"setup.sh: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"deepspeed {deepspeed.__version__}, cuda={torch.cuda.is_available()}")
PY
echo "$want" > "$stamp"
