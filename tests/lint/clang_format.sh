#!/usr/bin/env bash
# Checks (or with --fix, rewrites) the layout of every tracked C++ and CUDA
# source against .clang-format, with clang-format-14 (PLSH_CLANG_FORMAT
# overrides). Exit 1 naming each line that differs.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
cf=${PLSH_CLANG_FORMAT:-clang-format-14}
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
if ! "$cf" --dry-run --Werror "${files[@]}"; then
  echo "clang-format: some of the ${#files[@]} files are not laid out as .clang-format says (bash tests/lint/clang_format.sh --fix)"
  exit 1
fi
echo "clang-format: ${#files[@]} files checked, all laid out as .clang-format says"
