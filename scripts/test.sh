#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs the whole suite through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The official openai npm package for the HTTP tests, pinned by tests/http/package-lock.json.
npm ci --prefix tests/http --no-audit --no-fund
. scripts/env.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 900
