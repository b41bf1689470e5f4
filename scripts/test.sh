#!/usr/bin/env bash
# The whole test suite on the CPU: create .venv if needed, install the package with its test extra,
# run pytest with the Triton kernels in the interpreter (TRITON_INTERPRET=1).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh tests/test_routing.py -x
# README's quick start and .ci/run both call this script.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -e ".[test]"
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest "$@"
