// The cache level a lone pass over a layer's weights (a decode step's one row) prefetches its
// stream into, some KiB ahead: non-temporal where the kernels were tuned (Zen 4), L2 on Intel's
// Xeons (built with AMX tiles: Sapphire Rapids on). There a request into L1 holds one of the core's
// few fill buffers until its line arrives, and those capped each core's stream at about half of
// what the memory gives it. Such a Xeon, one row a call, 16 layers of each of the 250M model's
// shapes from memory (benchmarks/quant_kernels.py --stream), GB/s: non-temporal Q8_0 12.3, MXFP4
// 15.5, IQ4_XS 15.3; into L2 29.0, 25.1, 26.1; into every level 30.3, 23.5, 25.3; into L2 from 2 KiB
// or 8 KiB ahead 2-14% under 4 KiB. A compile-time choice: a flag tested in the loops cost IQ4_XS
// and Q4_K back to about 15.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

#if defined(__AMX_TILE__)
constexpr auto kStreamHint = _MM_HINT_T1;
#else
constexpr auto kStreamHint = _MM_HINT_NTA;
#endif
#endif
