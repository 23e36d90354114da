/* Fused row-wise CPU kernels for the decoder layer: SiLU-and-multiply, and RMSNorm with
 * the residual add folded in. One pass over each row in float32, rounding once at the end
 * (PyTorch's unfused bfloat16 ops round after every op and walk memory once per op).
 *
 * Built and called like paged_decode.c (see radixserve/executor/native/__init__.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define IDENTITY(x) (x)

/* out[r, i] = silu(x[r, i]) * x[r, d + i] for x [rows, 2d] and out [rows, d], contiguous. */
#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE)                                     \
    void NAME(const T *x, T *out, int64_t rows, int64_t d, int num_threads) {        \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")         \
        for (int64_t r = 0; r < rows; r++) {                                          \
            const T *gate = x + r * 2 * d, *up = gate + d;                            \
            T *o = out + r * d;                                                       \
            for (int64_t i = 0; i < d; i++) {                                         \
                const float g = LOAD(gate[i]);                                        \
                /* clamped: exp(80) is finite, so fast-math division never meets inf */ \
                const float e = expf(fminf(-g, 80.0f));                               \
                o[i] = STORE(g / (1.0f + e) * LOAD(up[i]));                           \
            }                                                                         \
        }                                                                             \
    }

/* If add is not NULL: residual[r] += add[r] (stored in T, as an unfused add would).
 * Then out[r] = residual[r] / sqrt(mean(residual[r]^2) + eps) * weight. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                     \
    void NAME(const T *add, T *residual, const T *weight, T *out, int64_t rows,       \
              int64_t d, float eps, int num_threads) {                                \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")         \
        for (int64_t r = 0; r < rows; r++) {                                          \
            T *res = residual + r * d;                                                \
            T *o = out + r * d;                                                       \
            float sum = 0.0f;                                                         \
            if (add != 0) {                                                           \
                const T *a = add + r * d;                                             \
                for (int64_t i = 0; i < d; i++) {                                     \
                    const T v = STORE(LOAD(res[i]) + LOAD(a[i]));                     \
                    res[i] = v;                                                       \
                    const float f = LOAD(v);                                          \
                    sum += f * f;                                                     \
                }                                                                     \
            } else {                                                                  \
                for (int64_t i = 0; i < d; i++) {                                     \
                    const float f = LOAD(res[i]);                                     \
                    sum += f * f;                                                     \
                }                                                                     \
            }                                                                         \
            const float scale = 1.0f / sqrtf(sum / (float)d + eps);                   \
            for (int64_t i = 0; i < d; i++)                                           \
                o[i] = STORE(LOAD(res[i]) * scale * LOAD(weight[i]));                 \
        }                                                                             \
    }

DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, IDENTITY, IDENTITY)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, IDENTITY, IDENTITY)
