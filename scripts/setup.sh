#!/usr/bin/env bash
# Sets up everything tenplex needs on a fresh Debian/Ubuntu machine:
# FUSE (system package), a virtual environment in .venv, the CPU build of
# PyTorch, and tenplex itself with its test extras. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

if ! command -v fusermount3 >/dev/null 2>&1 && ! command -v fusermount >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing fuse3 and libfuse2"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse2 >/dev/null
  else
    echo "[setup] warning: FUSE is not installed; FUSE tests will be skipped" >&2
  fi
fi

if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing iproute2 (ip, tc: the emulated cluster's network namespaces and links)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
  else
    echo "[setup] warning: iproute2 is not installed; emulated-cluster tests will be skipped" >&2
  fi
fi

if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing prometheus (the metrics tests scrape tenplex with a real one)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "[setup] warning: prometheus is not installed; the metrics tests fail in CI, skip elsewhere" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
stamp="$VENV/.tenplex-installed"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 (CPU) and tenplex[test]"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test,fuse,k8s]'
  touch "$stamp"
fi
