#!/usr/bin/env bash
# Installs every Debian 12 package that plsh's build, tests and tools need.
# Idempotent; works as root or through sudo. CUDA is not installed here: the
# build detects nvcc and cuBLAS when present and builds the CPU backend alone
# otherwise.
#
#   setup.sh          everything (scripts/dev.sh, CI)
#   setup.sh build    what compiling plsh-server and plsh needs, nothing for
#                     the tests: the Dockerfile's build stage (0.9 GB of
#                     packages; the test tools would add 1.1 GB)
set -euo pipefail

build_packages=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev
  prometheus-cpp-dev libmicrohttpd-dev
  # libcrypto: token digests and the TLS files' checks (server/auth.h, tls.h);
  # the openssl command makes the trust tests' certificates.
  libssl-dev openssl
  # Not linked: prometheus-cpp's CMake config asks for civetweb (its Exposer's server) all the same.
  libcivetweb-dev
  libopenblas-dev
)
test_packages=(
  libgtest-dev libgmock-dev googletest
  python3-grpcio python3-numpy python3-pytest python3-protobuf
  # client/python as a package (ctest python_packaging: pip install into a
  # fresh venv, offline; its build runs Debian's setuptools and wheel and
  # protoc), and its static checks (ctest python_mypy, python_flake8).
  python3-venv python3-setuptools python3-wheel python3-mypy flake8
  # The torch client's tests and the training example (plsh_client.torch,
  # examples/train_alibi.py): Debian's PyTorch 1.13 (CPU) and matplotlib.
  python3-torch python3-matplotlib
  # bench/paper/paper.py's corpus (and its ctest smoke run): the King James Bible, printed by
  # `bible`; the text's copyright has expired (1611), the program is GPL-2+ (/usr/share/doc/bible-kjv/copyright).
  bible-kjv
  prometheus curl
  python3-yaml docker-compose golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev
  # tests/deploy/image_test.py: the image built with podman on debootstrap bases.
  podman debootstrap
  # The fuzz targets (tests/fuzz/run.sh): clang with libFuzzer and its sanitizer runtimes, clang's OpenMP
  # for the kernels, and llvm-symbolizer for readable ASan/UBSan stack traces (GCC's sanitizers use it too).
  clang-16 libfuzzer-16-dev libclang-rt-16-dev libomp-16-dev llvm
  # The C++ static checks (ctest lint_clang_format and lint_clang_tidy; .clang-format, .clang-tidy).
  clang-format-14 clang-tidy-16
)

case "${1:-all}" in
  all) packages=("${build_packages[@]}" "${test_packages[@]}") ;;
  build) packages=("${build_packages[@]}") ;;
  *) echo "usage: setup.sh [build]" >&2; exit 2 ;;
esac

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "setup.sh: need root or sudo to install Debian packages" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup.sh: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update
"${as_root[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
