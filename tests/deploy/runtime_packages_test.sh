#!/usr/bin/env bash
# deploy/docker/runtime-packages.sh on the real binaries: it must name the
# packages of the libraries they load (gRPC, protobuf, libmicrohttpd, the
# C++ runtime), only installed ones, and fail on a library that nothing
# provides.
set -euo pipefail
script=$1
shift
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

bash "$script" "$@" > "$tmp/packages.txt"
echo "runtime packages of $*:"
sed 's/^/  /' "$tmp/packages.txt"

fail() { echo "FAIL: $*" >&2; exit 1; }
grep -qx libc6 "$tmp/packages.txt" || fail "libc6 missing"
grep -qx libstdc++6 "$tmp/packages.txt" || fail "libstdc++6 missing"
grep -q '^libgrpc++' "$tmp/packages.txt" || fail "no libgrpc++ package"
grep -q '^libprotobuf[0-9]' "$tmp/packages.txt" || fail "no libprotobuf package"
grep -q '^libmicrohttpd[0-9]' "$tmp/packages.txt" || fail "no libmicrohttpd package (the /metrics server)"
# civetweb (prometheus-cpp's Exposer) crashed on any request but GET /metrics.
! grep -q '^libcivetweb' "$tmp/packages.txt" || fail "civetweb is loaded again"
! grep -q -- '-dev$' "$tmp/packages.txt" || fail "a -dev package is listed"
while read -r pkg; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
    || fail "$pkg is not an installed package"
done < "$tmp/packages.txt"

# A library that no package owns is an error unless it ships with the
# binaries (--ship: libplsh_cuda.so in the image); one that is not found at
# all is an error either way.
printf 'int main(void) { return 0; }\n' > "$tmp/m.c"
printf 'int plsh_own(void) { return 1; }\n' > "$tmp/own.c"
mkdir -p "$tmp/ship"
cc -shared -fPIC -o "$tmp/ship/libplshown.so" "$tmp/own.c"
cc -o "$tmp/needs" "$tmp/m.c" -L"$tmp/ship" -Wl,--no-as-needed -lplshown -Wl,-rpath,"$tmp/ship"
if bash "$script" "$tmp/needs" > /dev/null 2> "$tmp/err"; then
  fail "a library that no package owns was not reported"
fi
grep -q "libplshown.so, which no installed package owns" "$tmp/err" || fail "unexpected error: $(cat "$tmp/err")"
bash "$script" --ship "$tmp/ship" "$tmp/needs" > "$tmp/shipped.txt" || fail "--ship did not exempt libplshown.so"
grep -qx libc6 "$tmp/shipped.txt" || fail "--ship lost the other libraries' packages"
rm "$tmp/ship/libplshown.so"
if bash "$script" "$tmp/needs" > /dev/null 2> "$tmp/err"; then
  fail "a missing library was not reported"
fi
grep -q 'needs libplshown.so, which is not found' "$tmp/err" || fail "unexpected error: $(cat "$tmp/err")"
echo "runtime-packages.sh: packages found, shipped libraries exempt, unowned and missing ones reported"
