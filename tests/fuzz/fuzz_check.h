// The fuzz targets' property check: aborts with a message, so that libFuzzer
// (or the replay main) reports the input. Not assert(): the fuzz build may
// define NDEBUG, and these checks are the targets' whole point.
#pragma once

#include <cstdio>
#include <cstdlib>

#define PLSH_FUZZ_CHECK(cond, what)                                                    \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s: %s\n", __FILE__, __LINE__, #cond, \
                   static_cast<const char*>(what));                                    \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)
