#!/usr/bin/env bash
# Checks (or with --fix, rewrites) the layout of every tracked C++ and CUDA
# source against .clang-format, with clang-format-14 (PLSH_CLANG_FORMAT
# overrides). Exit 1 naming the files that differ, with the first lines of
# each difference.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
cf=${PLSH_CLANG_FORMAT:-clang-format-14}
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! "$cf" "$f" | diff -u "$f" - > /tmp/plsh-clang-format.$$ 2>&1; then
    echo "not laid out as .clang-format says: $f (bash tests/lint/clang_format.sh --fix)"
    head -20 /tmp/plsh-clang-format.$$
    bad=$((bad + 1))
  fi
done
rm -f /tmp/plsh-clang-format.$$
echo "clang-format: ${#files[@]} files checked, $bad differ"
[ "$bad" -eq 0 ]
