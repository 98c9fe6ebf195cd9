#!/usr/bin/env bash
# plsh's two entry points for a fresh Debian 12 machine:
#   scripts/dev.sh run    install packages, build, start the service
#   scripts/dev.sh test   install packages, build, run every test
# Extra arguments after `run` go to the server.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-run}
shift || true
jobs=${PLSH_JOBS:-$(nproc)}
build_dir=${PLSH_BUILD_DIR:-build}

bash scripts/setup.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j"$jobs"

case "$what" in
  run)
    exec "$build_dir/bin/plsh" demo "$@"
    ;;
  test)
    ctest --test-dir "$build_dir" --output-on-failure -j"$jobs" --timeout 900
    ;;
  *)
    echo "usage: scripts/dev.sh run|test" >&2
    exit 2
    ;;
esac
