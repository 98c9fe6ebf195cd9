// PLSH_VECTOR_CLONES: a function built twice, for AVX2 + FMA
// (x86-64-v3) and for the baseline, the one the CPU can run picked when
// the library loads (GCC's target_clones), so that its loops vectorise
// four doubles or eight floats wide without the build requiring AVX2.
// Nothing elsewhere (other compilers, other architectures).
//
// Internal to kernels/; not a public header.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PLSH_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PLSH_VECTOR_CLONES
#endif
