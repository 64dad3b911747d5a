/* Run-time CPU feature detection: CPUID for what the processor has, XGETBV for what the OS saves. */
#ifndef DSPARK_CPU_FEATURES_H
#define DSPARK_CPU_FEATURES_H

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DSPARK_X86 1
#else
#define DSPARK_X86 0
#endif

typedef struct {
    int sse42, avx, avx2, fma, f16c;
    int avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512vnni;
    int amx_tile, amx_bf16, amx_int8;
    int os_avx, os_avx512, os_amx;
} dspark_cpu_features;

static inline unsigned long long dspark_xgetbv(void) {
#if DSPARK_X86
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
#else
    return 0;
#endif
}

static inline dspark_cpu_features dspark_detect_cpu_features(void) {
    dspark_cpu_features f = {0};
#if DSPARK_X86
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    f.sse42 = (c >> 20) & 1;
    f.fma = (c >> 12) & 1;
    f.f16c = (c >> 29) & 1;
    f.avx = (c >> 28) & 1;
    int osxsave = (c >> 27) & 1;
    if (osxsave) {
        unsigned long long xcr0 = dspark_xgetbv();
        f.os_avx = (xcr0 & 0x6) == 0x6;                  /* XMM and YMM state */
        f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0; /* opmask, ZMM_Hi256, Hi16_ZMM */
        f.os_amx = (xcr0 & 0x60000) == 0x60000;          /* XTILECFG, XTILEDATA */
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f.avx2 = (b >> 5) & 1;
        f.avx512f = (b >> 16) & 1;
        f.avx512dq = (b >> 17) & 1;
        f.avx512bw = (b >> 30) & 1;
        f.avx512vl = (b >> 31) & 1;
        f.avx512vnni = (c >> 11) & 1;
        f.amx_bf16 = (d >> 22) & 1;
        f.amx_tile = (d >> 24) & 1;
        f.amx_int8 = (d >> 25) & 1;
    }
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) {
        f.avx512bf16 = (a >> 5) & 1;
    }
#endif
    return f;
}

/* The fused kernel family's rules for its paths (simd_dispatch.c), also what dspark info reports. */
static inline int dspark_cpu_runs_avx2(void) {
    dspark_cpu_features f = dspark_detect_cpu_features();
    return f.avx2 && f.fma && f.os_avx;
}
static inline int dspark_cpu_runs_avx512(void) {
    dspark_cpu_features f = dspark_detect_cpu_features();
    return f.avx512f && f.os_avx512;
}

/* Which ISA macros the compiler defined for this translation unit (the package's default flags). */
static inline int dspark_built_with_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}
static inline int dspark_built_with_avx512f(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
#endif
