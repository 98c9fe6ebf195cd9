#!/usr/bin/env bash
# Prints, one per line and sorted, the installed packages that provide the
# shared libraries the given ELF files load. The Dockerfile's build stage runs
# it so that the runtime stage installs exactly those packages: their names
# differ between Debian 12 and Ubuntu 24.04 (libgrpc++1.51 vs
# libgrpc++1.51t64) and between releases, and a hand-kept list goes stale.
#
#   runtime-packages.sh [--ship DIR]... FILE...
#
# --ship DIR: libraries found in DIR travel with the files (libplsh_cuda.so)
# and need no package. The GPU driver's libraries (libcuda, libnvidia-*) may
# be missing: the NVIDIA container runtime mounts them at run time. Any other
# library that is missing or that no package owns is an error.
set -euo pipefail

ship_dirs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ship) ship_dirs+=("$2"); shift 2 ;;
    --) shift; break ;;
    -*) echo "runtime-packages.sh: unknown option '$1'" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: runtime-packages.sh [--ship DIR]... FILE..." >&2
  exit 2
fi

shipped() {
  local name=$1 dir
  for dir in "${ship_dirs[@]+"${ship_dirs[@]}"}"; do
    [ -e "$dir/$name" ] && return 0
  done
  return 1
}

# dpkg records the path a package ships, which on merged-/usr systems may be
# /lib/... while the loader reports /usr/lib/... (or the reverse), and the
# loader may reach a library through an alternatives symlink (OpenBLAS):
# each library is looked up under all of these names.
candidates() {
  local path=$1 real
  real=$(readlink -f -- "$path")
  printf '%s\n' "$path" "$real" "${path#/usr}" "/usr${path}" "${real#/usr}" "/usr${real}"
}

status=0
declare -A needed=()
for file in "$@"; do
  if [ ! -f "$file" ]; then
    echo "runtime-packages.sh: '$file' is not a file" >&2
    exit 2
  fi
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if [ "$path" = "not" ]; then
      case "$name" in
        libcuda.so.*|libnvidia-*) continue ;;
      esac
      shipped "$name" && continue
      echo "runtime-packages.sh: $file needs $name, which is not found" >&2
      status=1
      continue
    fi
    shipped "$name" || needed[$path]=$file
  done < <(ldd "$file")
done

# One dpkg-query for every name: it reads the whole file database per call.
declare -A owner_of=()
if [ ${#needed[@]} -gt 0 ]; then
  mapfile -t all < <(for path in "${!needed[@]}"; do candidates "$path"; done | sort -u)
  while IFS= read -r line; do
    case "$line" in "diversion by "*) continue ;; esac
    # "pkg1:amd64, pkg2: /path" -> pkg1 (diverted files list several).
    file=${line#*: }
    pkg=${line%%: /*}
    pkg=${pkg%%,*}
    owner_of[$file]=${pkg%%:*}
  done < <(dpkg-query -S -- "${all[@]}" 2>/dev/null || true)
fi

declare -A packages=()
for path in "${!needed[@]}"; do
  found=
  while IFS= read -r cand; do
    if [ -n "${owner_of[$cand]:-}" ]; then
      found=${owner_of[$cand]}
      break
    fi
  done < <(candidates "$path")
  if [ -n "$found" ]; then
    packages[$found]=1
  else
    echo "runtime-packages.sh: ${needed[$path]} needs $path, which no installed package owns" >&2
    status=1
  fi
done

[ "$status" -eq 0 ] || exit "$status"
printf '%s\n' "${!packages[@]}" | sort
