/* blake3_avx2.c compiled for avx2 whatever the build's flags: the dispatcher (blake3_dispatch.c)
 * calls it only on a CPU that has it. (The upstream build sets per-file flags, which
 * setuptools cannot; a target pragma does the same.) Empty off x86 (setup.py disables it). */
#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#include "blake3_avx2.c"
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC target("avx2")
#include "blake3_avx2.c"
#endif
#else
typedef int tk_blake3_avx2_unused; /* (ISO C: no empty translation unit) */
#endif
