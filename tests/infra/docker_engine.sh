#!/usr/bin/env bash
# A private Docker engine for the infrastructure tests (root, no systemd), and a base image
# built without any registry.
#
#   docker_engine.sh up DIR     (re)start dockerd; data, logs and pid file in DIR
#   docker_engine.sh base DIR   build belief-lm-ci/base: Debian bookworm from debootstrap
#                               with Python 3.11, g++ and the CPU torch wheel (standing in
#                               for the NGC image: a Python with torch and a compiler)
#   docker_engine.sh down DIR   remove its containers and networks, stop it, delete DIR
#
# Then: export DOCKER_HOST=unix://DIR/docker.sock. The engine touches neither iptables nor a
# default bridge (--iptables=false --bridge=none): containers reach only the networks a
# test creates; image builds use the host's network (--network host) to reach PyPI.
set -euo pipefail

cmd=${1:?usage: docker_engine.sh up|base|down DIR}
dir=$(realpath -m "${2:?usage: docker_engine.sh up|base|down DIR}")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DOCKER_HOST=unix://$dir/docker.sock
export DOCKER_BUILDKIT=0 # the classic builder: Debian's client has no buildx
exec_root=/run/blm-docker-$(basename "$dir") # unix sockets live here: a short path

stop() { # remove its containers and networks, stop dockerd, delete DIR
  if [[ -f $dir/dockerd.pid ]] && kill -0 "$(cat "$dir/dockerd.pid")" 2>/dev/null; then
    docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1 || true
    docker network prune -f >/dev/null 2>&1 || true
    pid=$(cat "$dir/dockerd.pid")
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  # dockerd leaves its network namespace mounted under exec-root
  findmnt -rn -o TARGET | { grep "^$exec_root/" || true; } | sort -r | xargs -r umount
  rm -rf "$dir" "$exec_root"
}

case $cmd in
up)
  for tool in dockerd docker debootstrap; do
    command -v "$tool" >/dev/null || { echo "docker_engine.sh: $tool is missing (tests/infra/install.sh)" >&2; exit 1; }
  done
  stop
  mkdir -p "$dir"
  dockerd --data-root="$dir/data" --exec-root="$exec_root" \
    --pidfile="$dir/dockerd.pid" --host="$DOCKER_HOST" --iptables=false --bridge=none \
    >"$dir/dockerd.log" 2>&1 &
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.25; done
  docker info --format 'docker_engine.sh: dockerd {{.ServerVersion}}, storage {{.Driver}}' || {
    tail -20 "$dir/dockerd.log" >&2
    exit 1
  }
  ;;
base)
  if ! docker image inspect belief-lm-ci/rootfs:bookworm >/dev/null 2>&1; then
    rootfs=$dir/rootfs
    rm -rf "$rootfs"
    # g++ and the Python headers, as NGC images have them: DeepSpeed builds its CPU
    # communication op with them
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python3-pip,python3-dev,g++,ca-certificates \
      bookworm "$rootfs" http://deb.debian.org/debian >"$dir/debootstrap.log" 2>&1 || {
      tail -20 "$dir/debootstrap.log" >&2
      exit 1
    }
    # This machine's egress intercepts TLS: pip in the image trusts what the host trusts.
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/host-ca-bundle.crt"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
      --change 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/host-ca-bundle.crt SSL_CERT_FILE=/etc/ssl/host-ca-bundle.crt' \
      --change 'CMD ["/bin/bash"]' - belief-lm-ci/rootfs:bookworm >/dev/null
    rm -rf "$rootfs"
  fi
  # torch as this machine's pip finds it (pip.conf / PIP_FIND_LINKS may hold the CPU
  # wheel; TORCH_INDEX_URL as in setup.sh), put into the image's system Python.
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --dest "$context" \
    "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  docker build --quiet --network host --tag belief-lm-ci/base \
    --file "$here/base.Dockerfile" "$context" >/dev/null
  echo "docker_engine.sh: belief-lm-ci/base ready"
  ;;
down)
  stop
  ;;
*)
  echo "docker_engine.sh: unknown command '$cmd' (up, base or down)" >&2
  exit 2
  ;;
esac
