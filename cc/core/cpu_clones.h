// A2A_CPU_CLONES: a hot CPU loop compiled twice, for AVX2 and for the baseline x86-64 the wheel is
// built for, the loader picking one per machine (GCC / Clang target_clones, an ELF ifunc). The
// host backend's row loops (the combine's reduction, the fp8 quantiser) ran 3-4x slower in baseline
// SSE2 code than in AVX2 code on the development VM (64 tokens x 8 rows x 1,024 bf16: ~205 against
// ~52 µs). No FMA in either clone: GCC contracts a * b + c into a fused multiply-add where the target
// has one (gnu++17's -ffp-contract=fast), which rounds once, so an AVX-512 or FMA clone would give
// other bits than the baseline; with these two every machine computes the same bits
// (tests/test_host.py checks the combine's sums against the oracle bit for bit). Elsewhere (aarch64,
// other compilers) the macro is empty.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__) && !defined(__CUDACC__) && \
    !defined(A2A_NO_CPU_CLONES)
#define A2A_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define A2A_CPU_CLONES
#endif
