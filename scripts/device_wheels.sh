#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels that scripts/device_check.sh
# needs on the accelerator machine and its image lacks (scripts/
# device_wheels.txt), built for that machine's Python 3.12 on x86-64 Linux,
# into .whl/ (ignored by git; it travels with the working tree):
#
#   bash scripts/device_wheels.sh
#
# device_check.sh installs whatever .whl/ holds, without network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
grep -v '^\s*#' scripts/device_wheels.txt | sed 's/#.*//; s/\s//g' |
  grep -v '^$' | while read -r req; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$req"
  done
ls -l .whl
du -sh .whl
