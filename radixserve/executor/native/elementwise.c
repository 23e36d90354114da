/* Fused row-wise CPU kernels for the decoder layer: SiLU-and-multiply (and GeGLU, bfloat16
 * with AVX-512), and RMSNorm with the residual add folded in. One pass over each row in float32, rounding once at the end
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* exp(x) for x <= 88 (a Cephes-style polynomial on x - n ln2, then 2^n by scalef). The same
 * function as paged_decode.c's exp16, copied on purpose: each kernel is one self-contained
 * source. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* silu(g) * u; -g clamped at 80: exp(80) is finite, so the division never meets inf */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(80.0f)));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.0f))), u);
}

/* bfloat16 SiLU-and-multiply, 16 lanes at a time (a vectorised exp; the scalar loop's expf
 * does not vectorise) */
void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t d,
                       int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * d, *up = gate + d;
        uint16_t *o = out + r * d;
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) { /* full vectors: plain loads and stores */
            const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gate + i))), 16));
            const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(up + i))), 16));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(silu_mul16(g, u)));
        }
        if (i < d) { /* the tail, masked */
            const __mmask16 m = (__mmask16)((1u << (d - i)) - 1u);
            const __m512 g = load_bf16x16(gate + i, m), u = load_bf16x16(up + i, m);
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(silu_mul16(g, u)));
        }
    }
}

/* gelu_tanh(g) * u, gelu_tanh(g) = g / 2 (1 + tanh(c (g + 0.044715 g^3))) with c = sqrt(2 / pi),
 * written g / (1 + exp(-2 c (g + 0.044715 g^3))) (g times a sigmoid: no cancellation for
 * negative g); the exponent clamped at 80 (exp(80) is finite, so the division never meets
 * inf, and the result underflows to 0 there) */
static inline __m512 gelu_tanh_mul16(__m512 g, __m512 u) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 a = _mm512_mul_ps(_mm512_set1_ps(-2.0f * 0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    const __m512 e = exp16(_mm512_min_ps(a, _mm512_set1_ps(80.0f)));
    const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
    /* rounded to bfloat16 before the product, as the unfused model rounds it (its gelu's
     * output is a bfloat16 tensor): with one rounding, Gemma 3's greedy tokens left
     * transformers' on the real Q4_K_M file (test_gemma3_gguf.py) */
    const __m512 gelu16 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(gelu)), 16));
    return _mm512_mul_ps(gelu16, u);
}

/* bfloat16 GeGLU (Gemma's gelu_pytorch_tanh(gate) * up), as silu_and_mul_bf16 but rounding
 * twice, as PyTorch's two ops do */
void gelu_tanh_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t d,
                            int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * d, *up = gate + d;
        uint16_t *o = out + r * d;
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = d - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - i)) - 1u);
            const __m512 g = load_bf16x16(gate + i, m), u = load_bf16x16(up + i, m);
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(gelu_tanh_mul16(g, u)));
        }
    }
}

static inline __m512 bf16x16_to_f32(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* bfloat16 add + RMSNorm, 16 lanes at a time: the same function as DEFINE_ADD_RMS_NORM
 * (the sum of squares in float32 over the residual rounded to bfloat16; the result rounded
 * once), only the order of the float32 additions differs. */
void add_rms_norm_bf16(const uint16_t *add, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t d, float eps, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * d;
        uint16_t *o = out + r * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = d - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - i)) - 1u);
            __m256i xb = _mm256_maskz_loadu_epi16(m, res + i);
            if (add != 0) {
                const __m512 sum = _mm512_add_ps(bf16x16_to_f32(xb),
                                                 bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, add + r * d + i)));
                xb = (__m256i)_mm512_cvtneps_pbh(sum);
                _mm256_mask_storeu_epi16(res + i, m, xb);
            }
            const __m512 x = bf16x16_to_f32(xb);
            acc = _mm512_fmadd_ps(x, x, acc);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)d + eps));
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 m = d - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - i)) - 1u);
            const __m512 x = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, res + i));
            const __m512 w = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, weight + i));
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(x, scale), w)));
        }
    }
}
int has_gelu_tanh_and_mul(void) { return 1; }

/* The first maximum of x[0:n] (bfloat16) as float: *value and *index, or in *nan the index
 * of the first NaN (-1 if none). 16 lanes keep each its own first maximum (strictly greater
 * replaces); the lanes then give the greatest value and, among equals, the least index. */
static void argmax_span_bf16(const uint16_t *x, int64_t n, float *value, int64_t *index,
                             int64_t *nan) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_i = _mm512_set1_epi32(INT32_MAX);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *nan = -1;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = load_bf16x16(x + i, m);
        const __mmask16 unord = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        if (unord) {
            *nan = *index = i + __builtin_ctz(unord);
            *value = NAN;
            return;
        }
        /* the first 16 take their own values, -inf ones included (a row of -inf: index 0) */
        const __mmask16 up = i == 0 ? m : _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, up, v);
        best_i = _mm512_mask_mov_epi32(best_i, up, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    *value = top;
    *index = _mm512_mask_reduce_min_epi32(at, best_i);
}

/* out[r] = the index of the first maximum of row r of x [rows, n] (bfloat16, rows
 * contiguous, n < 2^31), what torch.max(x, dim=-1).indices gives: a NaN counts above every
 * number (its first index). Rows are cut into spans so that one row uses every thread. */
void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out,
                      int num_threads) {
    if (rows <= 0 || n <= 0) return;
    int64_t spans = rows >= num_threads ? 1 : (num_threads + rows - 1) / rows;
    if (spans > 64) spans = 64;
    const int64_t width = ((n + spans - 1) / spans + 15) / 16 * 16;
    spans = (n + width - 1) / width;
    float values[rows * spans];
    int64_t index[rows * spans], nan[rows * spans];
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t t = 0; t < rows * spans; t++) {
        const int64_t r = t / spans, start = (t % spans) * width;
        const int64_t len = n - start < width ? n - start : width;
        argmax_span_bf16(x + r * n + start, len, &values[t], &index[t], &nan[t]);
        index[t] += start;
        if (nan[t] >= 0) nan[t] += start;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = -1, first_nan = -1;
        float top = 0.0f;
        for (int64_t s = 0; s < spans; s++) {
            const int64_t t = r * spans + s;
            if (nan[t] >= 0) {
                first_nan = nan[t];
                break;
            }
            if (best < 0 || values[t] > top) {
                top = values[t];
                best = index[t];
            }
        }
        out[r] = first_nan >= 0 ? first_nan : best;
    }
}
#else
int has_gelu_tanh_and_mul(void) { return 1; }

/* bfloat16 GeGLU, as the AVX-512 version above: g / (1 + exp(-2 c (g + 0.044715 g^3))), the
 * exponent clamped at 80, rounded to bfloat16 before the product (as PyTorch's two ops);
 * expf vectorises through libmvec where the tier has it (this file is built with
 * -ffast-math) */
void gelu_tanh_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t d,
                            int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * d, *up = gate + d;
        uint16_t *o = out + r * d;
        for (int64_t i = 0; i < d; i++) {
            const float g = bf16_to_f32(gate[i]);
            const float a = -2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
            const float gelu = g / (1.0f + expf(a < 80.0f ? a : 80.0f));
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gelu)) * bf16_to_f32(up[i]));
        }
    }
}
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* argmax_rows_bf16 one row per thread, scalar: the same answer as the AVX-512 version */
void argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out,
                      int num_threads) {
    if (rows <= 0 || n <= 0) return;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * n;
        int64_t best = 0;
        float top = bf16_to_f32(row[0]);
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_f32(row[i]);
            if ((row[i] & 0x7FFFu) > 0x7F80u) { /* NaN, tested on the bits: this file is
                                                   built with -ffast-math, which drops v != v */
                best = i;
                break;
            }
            if (v > top) {
                top = v;
                best = i;
            }
        }
        out[r] = best;
    }
}
#endif
DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, IDENTITY, IDENTITY)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, IDENTITY, IDENTITY)

/* Rotary embedding (Hugging Face's rotate-half layout), in place: x holds `rows` tokens of
 * `heads` heads of size d, token r at x + r * row_stride (q and k of a fused qkv row);
 * cos and sin_signed are that token's full-width tables [rows, d] (sin_signed = [-sin, sin]).
 * x[i] <- x[i] cos[i] + x[i +- d/2] sin_signed[i], in float32, rounded once. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                           \
    void NAME(T *x, int64_t rows, int64_t heads, int64_t d, int64_t row_stride,       \
              const T *cos, const T *sin_signed, int num_threads) {                   \
        const int64_t half = d / 2;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")         \
        for (int64_t r = 0; r < rows; r++) {                                          \
            const T *c = cos + r * d, *s = sin_signed + r * d;                        \
            for (int64_t h = 0; h < heads; h++) {                                     \
                T *v = x + r * row_stride + h * d;                                    \
                for (int64_t i = 0; i < half; i++) {                                  \
                    const float a = LOAD(v[i]), b = LOAD(v[i + half]);                \
                    v[i] = STORE(a * LOAD(c[i]) + b * LOAD(s[i]));                    \
                    v[i + half] = STORE(b * LOAD(c[i + half]) + a * LOAD(s[i + half])); \
                }                                                                     \
            }                                                                         \
        }                                                                             \
    }

DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROTARY(rotary_f32, float, IDENTITY, IDENTITY)

/* The KV of a step's new tokens into the paged cache, any element type: token t's head h
 * (head_bytes at k + t * k_row_stride + h * head_bytes, likewise v; k and v may be views
 * into a fused qkv row) goes to slot slots[t], i.e. row slots[t] % page_size of block
 * (slots[t] / page_size, h) of a cache laid out [pages, kv_heads, page_size, head]. One
 * memcpy per (token, head) instead of an advanced-indexing scatter. */
void kv_write(const char *k, const char *v, int64_t k_row_stride, int64_t v_row_stride,
              char *k_cache, char *v_cache, const int64_t *slots, int64_t tokens,
              int64_t kv_heads, int64_t page_size, int64_t head_bytes, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 256)")
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t page = slots[t] / page_size, slot = slots[t] % page_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t dst = ((page * kv_heads + h) * page_size + slot) * head_bytes;
            memcpy(k_cache + dst, k + t * k_row_stride + h * head_bytes, (size_t)head_bytes);
            memcpy(v_cache + dst, v + t * v_row_stride + h * head_bytes, (size_t)head_bytes);
        }
    }
}

/* kv_write into an int8 cache (kv_cache.py's quantize_int8): each (token, head) row of d
 * values becomes int8 codes round(x / scale), scale = max|x| / 127 (0 for an all-zero row,
 * codes 0), the codes at its slot of the [pages, kv_heads, page_size, d] code cache and the
 * scale at [pages, kv_heads, page_size]. Row strides in elements. */
#define DEFINE_KV_WRITE_INT8(NAME, T, LOAD)                                                   \
    void NAME(const T *k, const T *v, int64_t k_row_stride, int64_t v_row_stride,            \
              int8_t *k_codes, int8_t *v_codes, float *k_scale, float *v_scale,              \
              const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t page_size,     \
              int64_t d, int num_threads) {                                                  \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)") \
        for (int64_t t = 0; t < tokens; t++) {                                               \
            const int64_t page = slots[t] / page_size, slot = slots[t] % page_size;          \
            for (int64_t h = 0; h < kv_heads; h++) {                                         \
                const int64_t row = (page * kv_heads + h) * page_size + slot;                \
                for (int which = 0; which < 2; which++) {                                    \
                    const T *x = which ? v + t * v_row_stride + h * d                        \
                                       : k + t * k_row_stride + h * d;                       \
                    int8_t *codes = (which ? v_codes : k_codes) + row * d;                   \
                    float amax = 0.0f;                                                       \
                    for (int64_t i = 0; i < d; i++) {                                        \
                        const float a = fabsf(LOAD(x[i]));                                   \
                        amax = a > amax ? a : amax;                                          \
                    }                                                                        \
                    const float scale = amax * (1.0f / 127.0f);                              \
                    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;                    \
                    for (int64_t i = 0; i < d; i++) {                                        \
                        float c = nearbyintf(LOAD(x[i]) * inv);                              \
                        c = c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c);               \
                        codes[i] = (int8_t)c;                                                \
                    }                                                                        \
                    (which ? v_scale : k_scale)[row] = scale;                                \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

#define KV_IDENTITY(x) (x)
DEFINE_KV_WRITE_INT8(kv_write_int8_bf16, uint16_t, bf16_to_f32)
DEFINE_KV_WRITE_INT8(kv_write_int8_f32, float, KV_IDENTITY)
