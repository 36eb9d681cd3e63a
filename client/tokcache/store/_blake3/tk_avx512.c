/* blake3_avx512.c compiled for avx512f,avx512vl whatever the build's flags: the dispatcher (blake3_dispatch.c)
 * calls it only on a CPU that has it. (The upstream build sets per-file flags, which
 * setuptools cannot; a target pragma does the same.) Empty off x86 (setup.py disables it). */
#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl"))), apply_to = function)
#include "blake3_avx512.c"
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512vl")
#include "blake3_avx512.c"
#endif
#else
typedef int tk_blake3_avx512_unused; /* (ISO C: no empty translation unit) */
#endif
