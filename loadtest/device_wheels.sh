#!/usr/bin/env bash
# Here, before a device run: the wheels loadtest/device_check.sh needs that the device machine's image lacks
# (its python3 is 3.12 with torch, transformers, pytest, numpy, safetensors, httpx and pyyaml), at the versions
# this checkout's .venv holds, into .whl/ (kept out of git): the run then carries ".whl".
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$(.venv/bin/python -m pip freeze 2>/dev/null | grep -iE '^(structlog|opentelemetry-api|llguidance|msgspec)==')
[ "$(echo "$pins" | wc -l)" -eq 4 ] || { echo "device_wheels: .venv lacks one of the packages: $pins" >&2; exit 1; }
rm -rf .whl
# shellcheck disable=SC2086 -- one argument per pin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl $pins
ls -l .whl
