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

/* eight float16 values as float32 (exact: normal, subnormal, infinite and NaN) */
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

/* eight int8 codes as float32 */
static inline f32x8 i8x8_f32(const int8_t *p) {
    i8x8 c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(c, f32x8);
}

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
#endif
