#!/usr/bin/env bash
# System packages for the infrastructure tests (tests/infra): a SLURM cluster (slurmctld,
# slurmd, munge), a Docker engine (docker.io, iptables, docker-compose v1) and debootstrap
# for a registry-free base image. Debian/Ubuntu as root; a no-op when all are installed.
# setup.sh --dev calls it under CI (or with --infra).
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge docker.io iptables docker-compose debootstrap iproute2)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [[ ${#missing[@]} == 0 ]]; then
  echo "install.sh: infrastructure packages are installed"
  exit 0
fi
if [[ $EUID != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install.sh: installing ${missing[*]} needs root and apt-get" >&2
  exit 1
fi

# Keep the packages' daemons from starting on install (the Debian policy-rc.d mechanism):
# the tests start their own slurmctld/slurmd/munged/dockerd with their own state and stop
# them afterwards; a system-wide dockerd or slurmctld would outlive the test run.
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  trap 'rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install.sh: installed ${missing[*]}"
