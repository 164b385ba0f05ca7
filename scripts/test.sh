#!/usr/bin/env bash
# Set up everything from nothing (a virtualenv with the project and its test
# dependencies) and run the whole test suite. Extra arguments go to pytest.
# The install runs again only when pyproject.toml changed since the last one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
stamp=.venv/.splitserve-installed
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
  echo "$wanted" > "$stamp"
fi
# The project's own modules compiled once, here: the suite starts hundreds of Python processes (services,
# the CLI), and where PYTHONDONTWRITEBYTECODE is set each would compile them from source again.
.venv/bin/python -m compileall -q contracts services shared loadtest tests > /dev/null
exec .venv/bin/python -m pytest "$@"
