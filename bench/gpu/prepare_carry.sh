#!/usr/bin/env bash
# Run HERE (the build machine), before bench/gpu/run.sh goes to a GPU machine
# through the device tool. The GPU machine has nvcc, CMake, ninja and PyTorch
# but (as far as KINDS.md says) no GoogleTest and no CBLAS, and it cannot
# download anything, so this copies them into two git-ignored folders that
# the run call carries:
#   .gtest/  GoogleTest's sources (Debian's /usr/src/googletest), built there
#   .blas/   the reference BLAS with its CBLAS interface (Debian's libblas3,
#            which needs nothing but libc) and the netlib cblas.h
# Then rehearse here with bash bench/gpu/run.sh /tmp/gpurehearsal, and call
#   run(command="bash bench/gpu/run.sh $OUT/gpu", carry=[".gtest", ".blas"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/../.."

src_gtest=/usr/src/googletest
blas_lib=/usr/lib/x86_64-linux-gnu/blas/libblas.so.3
blas_inc=/usr/include/x86_64-linux-gnu
for need in "$src_gtest/CMakeLists.txt" "$blas_lib" "$blas_inc/cblas-netlib.h" "$blas_inc/cblas_mangling.h"; do
  [ -e "$need" ] || { echo "prepare_carry.sh: missing $need (scripts/setup.sh installs googletest and libblas-dev)" >&2; exit 1; }
done

rm -rf .gtest .blas
cp -r "$src_gtest" .gtest
mkdir -p .blas/lib .blas/include
# Real files, not links: a link travels only as a link.
cp -L "$blas_lib" .blas/lib/libblas.so.3
cp -L "$blas_lib" .blas/lib/libblas.so
cp -L "$blas_inc/cblas-netlib.h" .blas/include/cblas.h
cp -L "$blas_inc/cblas_mangling.h" .blas/include/cblas_mangling.h
for d in .gtest .blas; do git check-ignore -q "$d" || { echo "prepare_carry.sh: .gtest/ and .blas/ must be git-ignored" >&2; exit 1; }; done
du -sh .gtest .blas
echo "next, here (no GPU needed): bash bench/gpu/run.sh /tmp/gpurehearsal   # the whole run as far as it goes"
echo "then the device call: run(command=\"bash bench/gpu/run.sh \$OUT/gpu\", carry=[\".gtest\", \".blas\"], timeout_s=600)"
