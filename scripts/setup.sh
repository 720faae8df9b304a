#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu machine (as root) or a Mac: system packages the test bed needs,
# then .venv with the project and its dev tools. Used by `make demo`, `make test` and CI.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages for the SSH test bed (Linux, as root): one place, scripts/testbed-setup.sh.
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    scripts/testbed-setup.sh
  else
    echo "setup: not root: skipping system packages (the SSH integration tests need root)" >&2
  fi
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

# Byte-compile our sources, as installing a wheel does: where PYTHONDONTWRITEBYTECODE is set (this CI's
# environment) an editable install would otherwise recompile every module on every `coordinator` start.
.venv/bin/python -m compileall -q coordinator worker >/dev/null
