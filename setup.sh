#!/usr/bin/env bash
# Make (or refresh) the project's virtualenv from nothing: torch first and pinned, then
# megatron-core, DeepSpeed (no op builds, no build isolation) and the project itself.
#
#   bash setup.sh          runtime: train / evaluate / generate
#   bash setup.sh --dev    + test, lint, evaluation and observability tools (the dev extra:
#                          test + eval + wandb + report + linters); under CI also --infra
#   bash setup.sh --infra  + system packages for tests/infra (SLURM, Docker; root, apt)
#
# One extra onto a made venv (W&B, say), its torch kept:
#   .venv/bin/pip install -c .venv/torch-constraint.txt -e '.[wandb]'
#
# For a machine without internet that has a CUDA PyTorch already (a GPU node, a container):
#
#   bash setup.sh --download-wheels DIR [--python-version 3.12 --platform manylinux_2_28_x86_64]
#                 [--have FILE]
#       on a machine with internet and a working .venv: write into DIR every wheel that the
#       runtime and the test extra need on that Python and platform (default: this machine's)
#       except torch and what only torch needs. DeepSpeed, on PyPI only as source, is built
#       here with DS_BUILD_OPS=0 (pure Python). --have FILE (e.g. the target's `pip freeze`)
#       names packages the target has: they are left out too, and pinned where it says
#       NAME==VERSION. DIR/wheelhouse.txt lists the wheels and their sizes.
#   bash setup.sh --wheelhouse DIR
#       on the target: install from DIR alone, the package index disabled, onto the torch
#       that PYTHON has (TORCH_VERSION defaults to system here; torch >= 2.6).
#
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_VERSION (default
# 2.13.0; "system": keep the torch that PYTHON already has, as in an NGC PyTorch image),
# TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu128 on a cluster whose default
# index has the wrong CUDA build; without it, a Linux machine without nvidia-smi gets the
# CPU build), WHEEL_PYTHON (--download-wheels with --python-version X.Y: the Python X.Y whose
# pip resolves, default pythonX.Y; pip evaluates requirement markers with the Python it runs
# on). Re-running is a no-op unless this script, pyproject.toml or the options changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEV=0
INFRA=0
DOWNLOAD=""
WHEELHOUSE=""
TARGET_PYTHON=""
PLATFORM=""
HAVE=""
value() { [[ $# -ge 2 && -n $2 ]] || { echo "setup.sh: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dev) DEV=1 ;;
    --infra) INFRA=1 ;;
    --download-wheels) value "$@"; DOWNLOAD=$2; shift ;;
    --wheelhouse) value "$@"; WHEELHOUSE=$2; shift ;;
    --python-version) value "$@"; TARGET_PYTHON=$2; shift ;;
    --platform) value "$@"; PLATFORM=$2; shift ;;
    --have) value "$@"; HAVE=$2; shift ;;
    *) echo "setup.sh: unknown option '$1' (known: --dev, --infra, --download-wheels DIR" \
         "[--python-version X.Y --platform TAG --have FILE], --wheelhouse DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z $DOWNLOAD && -n "$TARGET_PYTHON$PLATFORM$HAVE" ]]; then
  echo "setup.sh: --python-version, --platform and --have go with --download-wheels DIR" >&2
  exit 2
fi
if [[ -n $DOWNLOAD && ( -n $WHEELHOUSE || $DEV == 1 || $INFRA == 1 ) ]]; then
  echo "setup.sh: --download-wheels only writes a wheelhouse; give it alone" >&2
  exit 2
fi
if [[ -n $WHEELHOUSE && $DEV == 1 ]]; then
  # The wheelhouse holds the runtime and the test extra; lm-eval (eval extra) and the
  # linters stay out: lean, and some of lm-eval's dependencies exist only as source.
  echo "setup.sh: --dev needs the package index; a wheelhouse install includes the test tools" >&2
  exit 2
fi

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [[ -n $DOWNLOAD ]]; then
  BUILD_PY="$VENV/bin/python"  # its torch is what DeepSpeed's build imports
  "$BUILD_PY" -c "import torch, packaging" 2>/dev/null ||
    { echo "setup.sh: --download-wheels builds DeepSpeed with $VENV's torch: run bash setup.sh first" >&2; exit 1; }
  WHEEL_PYTHON=${WHEEL_PYTHON:-${TARGET_PYTHON:+python$TARGET_PYTHON}}
  WHEEL_PYTHON=${WHEEL_PYTHON:-$BUILD_PY}
  if [[ -n $TARGET_PYTHON ]] && ! "$WHEEL_PYTHON" -c "import sys, pip
sys.exit('%d.%d' % sys.version_info[:2] != '$TARGET_PYTHON')" 2>/dev/null; then
    echo "setup.sh: --python-version $TARGET_PYTHON needs a Python $TARGET_PYTHON with pip to resolve" \
      "with (pip evaluates requirement markers with the Python it runs on): put" \
      "python$TARGET_PYTHON on PATH or set WHEEL_PYTHON" >&2
    exit 1
  fi
  [[ -z $HAVE || -f $HAVE ]] || { echo "setup.sh: --have $HAVE: no such file" >&2; exit 2; }
  if [[ -d $DOWNLOAD && -n "$(ls -A "$DOWNLOAD")" ]]; then
    echo "setup.sh: $DOWNLOAD is not empty; remove it or name a new directory" >&2
    exit 2
  fi
  mkdir -p "$DOWNLOAD"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The target's tags. pip takes --platform literally, and many wheels are tagged only
  # manylinux2014 / manylinux_2_17: manylinux_2_N brings every older glibc's tag along.
  tags=()
  [[ -n $TARGET_PYTHON ]] && tags+=(--python-version "$TARGET_PYTHON")
  if [[ -n $PLATFORM ]]; then
    tags+=(--platform "$PLATFORM")
    if [[ $PLATFORM =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
      glibc=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
      for ((n = glibc - 1; n >= 5; n--)); do tags+=(--platform "manylinux_2_${n}_$arch"); done
      for alias in 2014:17 2010:12 1:5; do
        ((glibc >= ${alias#*:})) && tags+=(--platform "manylinux${alias%:*}_$arch")
      done
    fi
  fi
  pip_for_target() {
    "$WHEEL_PYTHON" -m pip --disable-pip-version-check -q "$1" --only-binary=:all: \
      "${tags[@]}" --find-links "$DOWNLOAD" "${@:2}"
  }

  DS_BUILD_OPS=0 "$BUILD_PY" -m pip wheel --disable-pip-version-check -q --no-deps \
    --no-build-isolation "deepspeed>=0.19,<0.20" -w "$DOWNLOAD"
  cat > "$work/wheelhouse.py" <<'PY'
"""requirements: what to resolve (pyproject's dependencies and test extra, torch, the
packaging tools) and --have's pins; select: the resolved wheels to keep, i.e. everything
reachable from the requirements without passing through torch or a --have package;
list: DIR/wheelhouse.txt, the wheels by size."""
import json, re, sys, tomllib
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canonical

step, work, have = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
lines = [line.split("#")[0].strip() for line in (Path(have).read_text() if have else "").splitlines()]
lines = [line for line in lines if line and not line.startswith("-")]
provided = {canonical(re.split(r"[\s@=<>!~;\[]", line, maxsplit=1)[0]) for line in lines}
if step == "requirements":
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    roots = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    (work / "requirements.txt").write_text("\n".join([*roots, "torch>=2.6", "pip", "setuptools>=68", "wheel"]))
    # a public NAME==VERSION is pinned; a local build (2.6.0a0+nv25.1) or a URL only named
    pins = [line for line in lines if re.fullmatch(r"[\w.-]+==[\w.!]+", line)]
    (work / "pins.txt").write_text("\n".join(pins) + "\n")
    sys.exit()
report = json.loads((work / "report.json").read_text())
dists = {canonical(d["metadata"]["name"]): d for d in report["install"]}
stop = {"torch"} | provided
keep, todo = {}, [(canonical(d["metadata"]["name"]), set(d.get("requested_extras") or ()))
                   for d in report["install"] if d.get("requested")]
while todo:
    name, extras = todo.pop()
    if name in stop or name not in dists or (name in keep and extras <= keep[name]):
        continue
    keep[name] = extras | keep.get(name, set())
    for text in dists[name]["metadata"].get("requires_dist", []):
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({**report["environment"], "extra": e})
                                     for e in ("", *keep[name])):
            todo.append((canonical(req.name), set(req.extras)))
if step == "select":
    for name in sorted(keep):
        print(f"{dists[name]['metadata']['name']}=={dists[name]['metadata']['version']}")
    sys.exit()
wheels = sorted(Path(sys.argv[4]).glob("*.whl"), key=lambda p: -p.stat().st_size)
mb = [p.stat().st_size / 2**20 for p in wheels]
(Path(sys.argv[4]) / "wheelhouse.txt").write_text("\n".join([
    f"# belief-lm wheelhouse for {sys.argv[5]}: bash setup.sh --wheelhouse DIR installs it",
    f"# left out (torch, what only torch needs, --have): {' '.join(sorted(set(dists) - set(keep)))}",
    *(f"{size:8.2f} MiB  {path.name}" for size, path in zip(mb, wheels)),
    f"{len(wheels)} wheels, {sum(mb):.1f} MiB", ""]))
PY
  "$BUILD_PY" "$work/wheelhouse.py" requirements "$work" "$HAVE"
  # What pip would install on the target, from the packages' metadata (installs nothing).
  PIP_CONSTRAINT="$work/pins.txt" pip_for_target install --dry-run --ignore-installed \
    --target "$work/target" --report "$work/report.json" -r "$work/requirements.txt"
  "$BUILD_PY" "$work/wheelhouse.py" select "$work" "$HAVE" > "$work/keep.txt"
  PIP_CONSTRAINT="" pip_for_target download --no-deps -d "$DOWNLOAD" -r "$work/keep.txt"
  "$BUILD_PY" "$work/wheelhouse.py" list "$work" "$HAVE" "$DOWNLOAD" \
    "python ${TARGET_PYTHON:-"$("$WHEEL_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"}, platform ${PLATFORM:-native}"
  cat "$DOWNLOAD/wheelhouse.txt"
  exit 0
fi

# CI runs the infrastructure tests for real, so there --dev brings their packages too.
case "${CI:-}" in "" | 0 | false | no) ;; *) [[ $DEV == 1 ]] && INFRA=1 ;; esac
[[ $INFRA == 1 ]] && bash tests/infra/install.sh

if [[ -n $WHEELHOUSE ]]; then
  [[ -d $WHEELHOUSE ]] || { echo "setup.sh: --wheelhouse $WHEELHOUSE: no such directory" >&2; exit 2; }
  TORCH_VERSION=${TORCH_VERSION:-system}
  # Every pip call below: this directory only, never an index. --pre: a preinstalled torch
  # such as NGC's 2.6.0a0+... is a pre-release, which would otherwise not satisfy torch>=2.6.
  PIP_FIND_LINKS=$(realpath "$WHEELHOUSE")
  export PIP_NO_INDEX=1 PIP_FIND_LINKS PIP_PRE=1
fi
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

"$PYTHON" - <<'PY' || { echo "setup.sh: Python >= 3.11 is required ($PYTHON)" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 11))
PY

stamp="$VENV/.belief-lm-setup"
want="$(cat setup.sh pyproject.toml | sha256sum | cut -c1-16) dev=$DEV torch=$TORCH_VERSION wheelhouse=$WHEELHOUSE"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup.sh: $VENV is up to date"
  exit 0
fi

venv_options=()
[[ $TORCH_VERSION == system ]] && venv_options=(--system-site-packages)  # to see its torch
if [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -m venv "${venv_options[@]}" "$VENV"; then
  # A system Python without ensurepip (Debian's python3 lacking python3-venv) still makes a
  # venv without pip; with the system's packages visible, the system's pip then serves it.
  [[ $TORCH_VERSION == system ]] || exit 1
  echo "setup.sh: making $VENV without pip; the system's pip installs into it" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv --without-pip "${venv_options[@]}" "$VENV"
fi
PY="$VENV/bin/python"
if [[ $TORCH_VERSION == system ]]; then
  # PYTHON may itself be a venv's (GPU images often keep torch in /opt/.../.venv): a venv
  # made from it sees the base interpreter's packages, not that venv's. Point at them too.
  "$PYTHON" -c "import site, sys; sys.prefix != sys.base_prefix and print('\n'.join(site.getsitepackages()))" \
    > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_system_packages.pth"
fi
LOG="$VENV/setup.log"  # what pip and the libraries say; shown only when a step fails
: > "$LOG"
pip_install() {
  "$PY" -m pip install --disable-pip-version-check -q "$@" 2>>"$LOG" \
    || { tail -n 40 "$LOG" >&2; echo "setup.sh: pip install $* failed (log: $LOG)" >&2; exit 1; }
}

if [[ -n $WHEELHOUSE ]]; then  # keep what the system has where it will do (a preinstalled
  pip_install pip "setuptools>=68" wheel  # torch may pin setuptools)
else
  pip_install --upgrade pip setuptools wheel
fi

# 1. torch, pinned and first; every later pip call is constrained to it, so a dependency
#    asking for another torch fails instead of pulling a (multi-GB CUDA) build over it.
if [[ $TORCH_VERSION == system ]]; then
  "$PY" -c "import torch" || { echo "setup.sh: TORCH_VERSION=system but $PYTHON has no torch" >&2; exit 1; }
  "$PY" -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 6))" ||
    { echo "setup.sh: the system torch is $("$PY" -c 'import torch; print(torch.__version__)'); belief-lm needs torch >= 2.6" >&2; exit 1; }
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

# 3. The project and the rest of its dependencies (megatron-core 0.16.x).
extras=""
[[ $DEV == 1 ]] && extras="[dev]"
[[ -n $WHEELHOUSE ]] && extras="[test]"
pip_install --no-build-isolation -e ".$extras"

# (DeepSpeed logs its accelerator on stdout as it is imported: only our line is shown)
check() {
  "$PY" -W ignore - 2>>"$LOG" <<PY
import torch, megatron.core, deepspeed, sentencepiece
assert "$TORCH_VERSION" in ("system", torch.__version__.split("+")[0]), torch.__version__
print(f"setup.sh: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"deepspeed {deepspeed.__version__}, cuda={torch.cuda.is_available()}"
      + (" (installed offline from ${WHEELHOUSE})" if "${WHEELHOUSE}" else ""))
PY
}
summary=$(check) || { tail -n 40 "$LOG" >&2; exit 1; }
grep "^setup.sh: " <<< "$summary"
echo "$want" > "$stamp"
