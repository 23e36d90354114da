/* Dense weights in panels, multiplied so that each row's result depends on that row alone:
 * the product of deterministic mode (executor/batch_invariant.py) for the layers that hold
 * plain bfloat16 or float32 weights (oneDNN's and MKL's GEMMs pick their blocking, and so
 * their sums' order, by the number of rows).
 *
 * Layout (batch_invariant.to_dense_panels), N padded to a multiple of 16 with zeros:
 *   panels [N/16][K][16], the weight's own type: element j of (block b, input k) is W[16 b + j, k].
 *
 * Each output is one chain of float32 multiply-adds over k = 0 .. K-1 in order, x widened to
 * float32 exactly: the same operations in the same order for a row whatever the other rows,
 * the tile it falls in or the thread that computes it (threads split the output blocks, never
 * a sum). Rows go in tiles of up to PORTABLE_TILE, so a tile reads each weight once for its
 * rows. Portable C on every tier (portable.h); the products and sums exactly as written.
 */
#include <stdint.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
#include "portable.h"

static inline float bf16_scalar(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f32_scalar(float f) { return f; }

static inline f32x8 f32x8_load(const float *p) {
    f32x8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the first `count` (at most 16) of a block's 16 outputs, lo then hi, at y */
static inline void store_f32x16(float *y, f32x8 lo, f32x8 hi, int64_t count) {
    float v[16];
    memcpy(v, &lo, sizeof lo);
    memcpy(v + 8, &hi, sizeof hi);
    memcpy(y, v, (size_t)(count < 16 ? count : 16) * sizeof(float));
}

/* y[m, :n] = x[m, :k] W^T (x rows k apart, y rows y_stride apart). Returns 0, or -1 on bad
 * shapes. */
#define DEFINE_DENSE(NAME, XT, WT, LOADX, LOADW, STORE)                                        \
    static inline __attribute__((always_inline)) void NAME##_tile(                           \
        const XT *x, int64_t k, const int MT, const WT *pb, XT *y, int64_t y_stride,         \
        int64_t count) {                                                                     \
        f32x8 acc[PORTABLE_TILE][2];                                                         \
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) acc[r][0] = acc[r][1] =        \
            splat_f32x8(0.0f);                                                               \
        for (int64_t i = 0; i < k; i++) {                                                    \
            __builtin_prefetch((const char *)(pb + 16 * i) + 1024);                          \
            const f32x8 w0 = LOADW(pb + 16 * i), w1 = LOADW(pb + 16 * i + 8);                \
            _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {                           \
                const f32x8 xv = splat_f32x8(LOADX(x[r * k + i]));                           \
                acc[r][0] += xv * w0;                                                        \
                acc[r][1] += xv * w1;                                                        \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++)                                 \
            STORE(y + r * y_stride, acc[r][0], acc[r][1], count);                            \
    }                                                                                        \
    int NAME(const XT *x, int64_t m, int64_t k, const WT *panels, int64_t n, XT *y,          \
             int64_t y_stride, int num_threads) {                                            \
        if (m < 1 || k < 1 || n < 1) return -1;                                              \
        const int64_t blocks = (n + 15) / 16;                                                \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                \
        for (int64_t b = 0; b < blocks; b++) {                                               \
            const WT *pb = panels + b * k * 16;                                              \
            const int64_t count = n - 16 * b;                                                \
            for (int64_t i = 0; i < ptile_count(m); i++) {                                   \
                const int64_t m0 = ptile_start(m, i);                                        \
                const XT *xt = x + m0 * k;                                                   \
                XT *yt = y + m0 * y_stride + 16 * b;                                         \
                switch (ptile_start(m, i + 1) - m0) {                                        \
                case 4: NAME##_tile(xt, k, 4, pb, yt, y_stride, count); break;               \
                case 3: NAME##_tile(xt, k, 3, pb, yt, y_stride, count); break;               \
                case 2: NAME##_tile(xt, k, 2, pb, yt, y_stride, count); break;               \
                default: NAME##_tile(xt, k, 1, pb, yt, y_stride, count); break;              \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        return 0;                                                                            \
    }

DEFINE_DENSE(dense_panels_bf16, uint16_t, uint16_t, bf16_scalar, bf16x8, store_bf16x16)
DEFINE_DENSE(dense_panels_f32, float, float, f32_scalar, f32x8_load, store_f32x16)
/* bfloat16 rows against float32 weights (an int8 layer's dequantized weight, exact) */
DEFINE_DENSE(dense_panels_bf16_f32w, uint16_t, float, bf16_scalar, f32x8_load, store_bf16x16)

#pragma GCC pop_options
