/* What the panel GEMMs' portable path (int4_panels.c, int8_panels.c without AVX-512 BF16)
 * is written in: GCC vector extensions of eight 32-bit lanes. The compiler lowers them to
 * whatever the kernel tier's flags allow (native/__init__.py, ISA tiers): one AVX2 register
 * (x86-64-v3), two SSE registers (the scalar tier, x86-64 baseline), two NEON registers
 * (aarch64). One source for every tier but AVX-512 BF16, and the same numbers in each (the
 * same float32 products and sums in the same order: only the instructions differ).
 *
 * Conversions are exact integer bit work, never a library call: bfloat16 to float32 is a
 * shift; float16 to float32 rebiases the exponent (subnormals through an int-to-float
 * convert); float32 to bfloat16 rounds to nearest even, as vcvtneps2bf16 does (a NaN stays
 * a quiet NaN).
 */
#ifndef RADIXSERVE_PORTABLE_H
#define RADIXSERVE_PORTABLE_H
#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

static inline u32x8 load_u32x8(const void *p) {
    u32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline u32x8 splat_u32x8(uint32_t a) { return (u32x8){a, a, a, a, a, a, a, a}; }

static inline f32x8 splat_f32x8(float a) { return (f32x8){a, a, a, a, a, a, a, a}; }

/* eight bfloat16 values as float32 */
static inline f32x8 bf16x8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    return (f32x8)(__builtin_convertvector(h, u32x8) << 16);
}

/* eight float16 values as float32 (exact: normal, subnormal, infinite and NaN; one vcvtph2ps
 * where the tier has F16C) */
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
static inline f32x8 f16x8(const uint16_t *p) {
    return (f32x8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else
static inline f32x8 f16x8(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8);
    const u32x8 sign = (u & 0x8000) << 16, em = u & 0x7FFF;
    const u32x8 normal = (em << 13) + (uint32_t)((127 - 15) << 23);
    const u32x8 special = (em << 13) | 0x7F800000u; /* infinity, NaN */
    const f32x8 sub = __builtin_convertvector((i32x8)em, f32x8) * 0x1p-24f;
    const u32x8 is_sub = (u32x8)(em < 0x400), is_special = (u32x8)(em >= 0x7C00);
    const u32x8 bits = (is_sub & (u32x8)sub) | (is_special & special) |
                       (~(is_sub | is_special) & normal);
    return (f32x8)(bits | sign);
}
#endif

/* eight int8 codes as float32 (GCC lowers a direct int8-to-float vector conversion lane by
 * lane: one sign-extending load per tier where it has one, else by 16-bit steps) */
#if defined(__AVX2__)
#include <immintrin.h>
static inline f32x8 i8x8_f32(const int8_t *p) {
    return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(__ARM_NEON)
#include <arm_neon.h>
static inline f32x8 i8x8_f32(const int8_t *p) {
    const int16x8_t w = vmovl_s8(vld1_s8(p));
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
    const float32x4_t hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)));
    f32x8 out;
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
}
#else
typedef int16_t i16x8 __attribute__((vector_size(16)));
static inline f32x8 i8x8_f32(const int8_t *p) {
    i8x8 c;
    memcpy(&c, p, sizeof c);
    const i16x8 w = __builtin_convertvector(c, i16x8);
    return __builtin_convertvector(__builtin_convertvector(w, i32x8), f32x8);
}
#endif

/* float32 to bfloat16, to nearest even; a NaN becomes a quiet NaN */
static inline u16x8 to_bf16x8(f32x8 f) {
    const u32x8 u = (u32x8)f;
    const u32x8 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const u32x8 nan = (u32x8)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), u16x8);
}

/* the first `count` (at most 16) of a block's 16 outputs, lo then hi, at y */
static inline void store_bf16x16(uint16_t *y, f32x8 lo, f32x8 hi, int64_t count) {
    uint16_t v[16];
    const u16x8 a = to_bf16x8(lo), b = to_bf16x8(hi);
    memcpy(v, &a, sizeof a);
    memcpy(v + 8, &b, sizeof b);
    memcpy(y, v, (size_t)(count < 16 ? count : 16) * sizeof(uint16_t));
}

/* x [m][k] bfloat16 widened to float32 into xf (same layout), and each row's sum over each
 * group of `group` inputs into xs [m][k / group] */
static inline void widen_rows(const uint16_t *x, int64_t m, int64_t k, int64_t group, float *xf,
                              float *xs) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                uint32_t u = (uint32_t)x[r * k + i] << 16;
                float v;
                memcpy(&v, &u, sizeof v);
                xf[r * k + i] = v;
                s += v;
            }
            xs[r * groups + g] = s;
        }
}

/* Row tiles of the portable GEMMs: at most PORTABLE_TILE rows each (a tile's accumulators in
 * 16 registers of eight lanes; a 3-row tile measured slower for int4 although 4 rows spill a
 * little), their sizes within one of each other; tile i starts at ptile_start(m, i). */
#define PORTABLE_TILE 4
static inline int64_t ptile_count(int64_t m) { return (m + PORTABLE_TILE - 1) / PORTABLE_TILE; }

static inline int64_t ptile_start(int64_t m, int64_t i) {
    const int64_t t = ptile_count(m), base = m / t, extra = m % t;
    return i * base + (i < extra ? i : extra);
}
#endif
