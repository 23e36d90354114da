/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * page-major cache [num_pages, kv_heads, page_size, head_dim], online softmax in float32.
 *
 * Plain C with OpenMP, built at first use by radixserve/executor/native/__init__.py and
 * called through ctypes on raw tensor pointers (no Python objects cross this boundary).
 * Each (sequence, kv head) task reads its pages once: no gather copy, no score tensor.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_PAGE 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One task: the `group` query heads that share kv head `h` of sequence `b`, over a cache of
 * C values (LOAD_C to float). SCALED: an int8 cache (kv_cache.py's quantize_int8), whose
 * k_scale/v_scale [num_pages, kv_heads, page_size] hold each token-head's float32 scale: a
 * key's score is its scale times q . codes, a value's weight is folded with its scale;
 * without it the scale arrays are NULL and unread. Plain C for every tier (the compiler
 * vectorises the loops over d); everything in float32. */
#define DEFINE_TASK(NAME, T, C, LOAD, LOAD_C, STORE, SCALED)                                 \
    static inline __attribute__((always_inline)) void NAME(                                 \
        const T *q, const C *k_cache, const C *v_cache, const float *k_scale,           \
        const float *v_scale, const int32_t *pages, int32_t seq_len, int kv_heads, int h,   \
        int group, int page_size, int d, float scale, int32_t lo, float softcap, T *out) {  \
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                    \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_PAGE], kf[MAX_HEAD_DIM];         \
        for (int g = 0; g < group; g++) {                                                   \
            const T *qr = q + (size_t)(h * group + g) * d;                                  \
            for (int i = 0; i < d; i++) qf[g][i] = LOAD(qr[i]) * scale;                     \
            for (int i = 0; i < d; i++) acc[g][i] = 0.0f;                                   \
            m[g] = -INFINITY;                                                               \
            l[g] = 0.0f;                                                                    \
        }                                                                                   \
        const size_t page_stride = (size_t)kv_heads * page_size * d;                        \
        const size_t scale_stride = (size_t)kv_heads * page_size;                           \
        for (int p = lo / page_size; p * page_size < seq_len; p++) {                        \
            const size_t base = (size_t)pages[p] * page_stride + (size_t)h * page_size * d; \
            const size_t sbase = (size_t)pages[p] * scale_stride + (size_t)h * page_size;   \
            const C *kp = k_cache + base, *vp = v_cache + base;                             \
            const float *ks = SCALED ? k_scale + sbase : NULL;                              \
            const float *vs = SCALED ? v_scale + sbase : NULL;                              \
            int n = seq_len - p * page_size;                                                \
            if (n > page_size) n = page_size;                                               \
            const int t0 = p * page_size < lo ? lo - p * page_size : 0;                     \
            for (int t = t0; t < n; t++) {                                                  \
                const C *kr = kp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD_C(kr[i]);                          \
                for (int g = 0; g < group; g++) {                                           \
                    float dot = 0.0f;                                                       \
                    for (int i = 0; i < d; i++) dot += qf[g][i] * kf[i];                    \
                    if (SCALED) dot *= ks[t];                                               \
                    s[g][t] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;        \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < group; g++) {                                               \
                float page_max = s[g][t0];                                                  \
                for (int t = t0 + 1; t < n; t++) page_max = s[g][t] > page_max ? s[g][t] : page_max; \
                const float new_m = page_max > m[g] ? page_max : m[g];                      \
                const float rescale = expf(m[g] - new_m);                                   \
                l[g] *= rescale;                                                            \
                for (int i = 0; i < d; i++) acc[g][i] *= rescale;                           \
                for (int t = t0; t < n; t++) {                                              \
                    s[g][t] = expf(s[g][t] - new_m);                                        \
                    l[g] += s[g][t];                                                        \
                }                                                                           \
                m[g] = new_m;                                                               \
            }                                                                               \
            for (int t = t0; t < n; t++) {                                                  \
                const C *vr = vp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD_C(vr[i]);                          \
                for (int g = 0; g < group; g++) {                                           \
                    const float w = SCALED ? s[g][t] * vs[t] : s[g][t];                     \
                    for (int i = 0; i < d; i++) acc[g][i] += w * kf[i];                     \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int g = 0; g < group; g++) {                                                   \
            T *o = out + (size_t)(h * group + g) * d;                                       \
            const float inv = 1.0f / l[g];                                                  \
            for (int i = 0; i < d; i++) o[i] = STORE(acc[g][i] * inv);                      \
        }                                                                                   \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* AVX-512 BF16 path for bfloat16 caches with head_dim a multiple of 32 (64, 128, ...).
 * Keys are taken 16 at a time (across page boundaries): q.k with vdpbf16ps (bf16 pairs,
 * float32 sums; q unscaled, the scale applied to the sums), the 16 dot products of one
 * query head reduced to one vector of 16 scores by a transpose-add tree, an online softmax
 * on that vector (a vectorised exp), then p.v with vdpbf16ps too: the weights rounded to
 * bf16 (as GPU flash attention does), two value rows interleaved into pairs. The next
 * block's rows are prefetched while one block is computed. */
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* lane j of the result = the sum of the 16 lanes of s[j] */
static inline __m512 sum16(const __m512 *s) {
    __m512 u[8], w[4];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                             _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp(x) for x <= 0 (softmax arguments), relative error ~2e-7; very negative x give 0 */
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

/* cap * tanh(x / cap), lane by lane (soft-capped scores; rare, so scalar tanhf) */
static inline __m512 softcap16(__m512 x, float cap) {
    __attribute__((aligned(64))) float v[16];
    _mm512_store_ps(v, x);
    for (int j = 0; j < 16; j++) v[j] = cap * tanhf(v[j] / cap);
    return _mm512_load_ps(v);
}

static const uint16_t zero_row[MAX_HEAD_DIM]; /* the partner of an odd block's last key */

static inline __attribute__((always_inline)) void task_bf16_avx512(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *pages,
    int32_t seq_len, int kv_heads, int h, int group, int page_size, int d, float scale,
    int32_t lo, float softcap, const float *state, uint16_t *out) {
    const int nq = d / 32, nv = d / 16; /* bf16 pairs per q row; float32 vectors per row */
    __m512bh qv[MAX_GROUP][MAX_HEAD_DIM / 32];
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16], dots[MAX_GROUP][16];
    float m[MAX_GROUP], l[MAX_GROUP];
    uint32_t pp[MAX_GROUP][8]; /* this block's softmax weights as bf16 pairs (keys 2i, 2i+1) */
    for (int g = 0; g < group; g++) {
        const uint16_t *qr = q + (size_t)(h * group + g) * d;
        for (int c = 0; c < nq; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * c));
        if (state != NULL) { /* continue from a shared prefix's partial result */
            const float *st = state + (size_t)(h * group + g) * (d + 2);
            for (int c = 0; c < nv; c++) acc[g][c] = _mm512_loadu_ps(st + 16 * c);
            m[g] = st[d];
            l[g] = st[d + 1];
        } else {
            for (int c = 0; c < nv; c++) acc[g][c] = _mm512_setzero_ps();
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
    }
    const size_t page_stride = (size_t)kv_heads * page_size * d;
    /* keys lo .. seq_len - 1 (lo > 0: a sliding window's first key) */
    int page = lo / page_size, off = lo % page_size; /* the next key whose rows are located */
    const uint16_t *rows[2][2][16]; /* [chunk parity][k or v][key in chunk] */
    /* locate the rows of the chunk starting at `start` and prefetch them (random pages
     * defeat the hardware prefetcher; this keeps the next chunk's loads in flight) */
#define LOCATE(buf, start)                                                                   \
    do {                                                                                     \
        const int cnt = seq_len - (start) < 16 ? seq_len - (start) : 16;                     \
        for (int j = 0; j < cnt; j++) {                                                      \
            const size_t row =                                                               \
                (size_t)pages[page] * page_stride + ((size_t)h * page_size + off) * d;       \
            (buf)[0][j] = k_cache + row;                                                     \
            (buf)[1][j] = v_cache + row;                                                     \
            for (int b = 0; b < d * 2; b += 64) {                                            \
                _mm_prefetch((const char *)((buf)[0][j]) + b, _MM_HINT_T0);                  \
                _mm_prefetch((const char *)((buf)[1][j]) + b, _MM_HINT_T0);                  \
            }                                                                                \
            if (++off == page_size) {                                                        \
                off = 0;                                                                     \
                page++;                                                                      \
            }                                                                                \
        }                                                                                    \
    } while (0)
    LOCATE(rows[0], lo);
    for (int start = lo, parity = 0; start < seq_len; start += 16, parity ^= 1) {
        const int n = seq_len - start < 16 ? seq_len - start : 16;
        const uint16_t *const *krow = rows[parity][0], *const *vrow = rows[parity][1];
        if (start + 16 < seq_len) LOCATE(rows[parity ^ 1], start + 16);
        for (int j = 0; j < n; j++) {
            __m512bh kv[MAX_HEAD_DIM / 32];
            for (int c = 0; c < nq; c++)
                kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(krow[j] + 32 * c));
            for (int g = 0; g < group; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < nq; c++) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
                dots[g][j] = a;
            }
        }
        for (int g = 0; g < group; g++)
            for (int j = n; j < 16; j++) dots[g][j] = _mm512_setzero_ps();
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int g = 0; g < group; g++) {
            __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                          _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(scale)));
            if (softcap > 0.0f) s = _mm512_mask_mov_ps(s, valid, softcap16(s, softcap));
            const float block_max = _mm512_reduce_max_ps(s);
            const float new_m = block_max > m[g] ? block_max : m[g];
            const float rescale = expf(m[g] - new_m);
            const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_m))));
            /* p.v runs on bf16 pairs (vdpbf16ps): the weights are rounded to bf16 here, and
             * the denominator sums the rounded values, so numerator and denominator agree */
            const __m256bh eb = _mm512_cvtneps_pbh(e);
            _mm256_storeu_si256((__m256i *)pp[g], (__m256i)eb);
            l[g] = l[g] * rescale + _mm512_reduce_add_ps(_mm512_cvtpbh_ps(eb));
            m[g] = new_m;
            if (rescale != 1.0f)
                for (int c = 0; c < nv; c++)
                    acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale));
        }
        /* two keys at a time: their value rows interleaved into bf16 pairs; acc[g][2c]
         * and acc[g][2c + 1] hold dims 32c + {0-3, 8-11, 16-19, 24-27} and the others */
        for (int j = 0; j < n; j += 2) {
            const uint16_t *v0 = vrow[j], *v1 = j + 1 < n ? vrow[j + 1] : zero_row;
            __m512i lo[MAX_HEAD_DIM / 32], hi[MAX_HEAD_DIM / 32];
            for (int c = 0; c < nq; c++) {
                const __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * c));
                const __m512i b = _mm512_loadu_si512((const void *)(v1 + 32 * c));
                lo[c] = _mm512_unpacklo_epi16(a, b);
                hi[c] = _mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < group; g++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[g][j / 2]);
                for (int c = 0; c < nq; c++) {
                    acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], w, (__m512bh)lo[c]);
                    acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], w, (__m512bh)hi[c]);
                }
            }
        }
    }
    /* undo the pair interleaving: output dim 8L + r (r < 4) is lane 4L + r of the first
     * accumulator of its 32-dim chunk, dim 8L + 4 + r lane 4L + r of the second */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second =
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int g = 0; g < group; g++) {
        uint16_t *o = out + (size_t)(h * group + g) * d;
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int c = 0; c < nq; c++) {
            const __m512 a = _mm512_mul_ps(acc[g][2 * c], inv);
            const __m512 b = _mm512_mul_ps(acc[g][2 * c + 1], inv);
            _mm256_storeu_si256((__m256i *)(o + 32 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, first, b)));
            _mm256_storeu_si256((__m256i *)(o + 32 * c + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(a, second, b)));
        }
    }
#undef LOCATE
}

/* ---- shared-prefix ("cascade") decode ------------------------------------------------
 * When every sequence of a decode batch starts with the same pages (a shared system prompt,
 * a few-shot prefix, n > 1 samples), the per-sequence tasks above would each read those keys
 * and pay the per-key reductions again. Here the prefix is attended once per kv head for all
 * the batch's query rows at once, as small matrix products: keys are repacked into "VNNI"
 * order (lane j of vector c = the bf16 pair (k[j][2c], k[j][2c+1]) of key j), so a query
 * pair broadcast and one vdpbf16ps give 16 keys' partial scores with no horizontal sum, and
 * value rows are interleaved in key pairs the way the p.v loop above does. The softmax is
 * online over chunks of PREFIX_CHUNK keys. The result per (sequence, query head) is a
 * partial state: acc[d] (the p.v loop's pair-interleaved order), m, l; the per-sequence
 * kernel starts from it and attends the rest of the sequence (see `state` above). */
#define PREFIX_CHUNK 256

/* keys [prefix_len] of kv head h -> kt [prefix_len/16][d/2][16] uint32 (16-key blocks);
 * values -> vi [prefix_len/2][d/16] vectors (per 32-dim chunk: the lo then hi unpack) */
static void repack_prefix(const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *pages, int prefix_len, int kv_heads, int h,
                          int page_size, int d, uint32_t *kt, __m512i *vi) {
    const size_t page_stride = (size_t)kv_heads * page_size * d;
    const int half = d / 2, nq = d / 32;
#define ROW(cache, t)                                                                        \
    ((cache) + (size_t)pages[(t) / page_size] * page_stride +                               \
     ((size_t)h * page_size + (t) % page_size) * d)
    for (int blk = 0; blk < prefix_len / 16; blk++) {
        uint32_t *dst = kt + (size_t)blk * half * 16;
        for (int j = 0; j < 16; j++) {
            const uint32_t *src = (const uint32_t *)ROW(k_cache, blk * 16 + j);
            for (int c = 0; c < half; c++) dst[c * 16 + j] = src[c];
        }
    }
    for (int t = 0; t < prefix_len; t += 2) {
        const uint16_t *v0 = ROW(v_cache, t), *v1 = ROW(v_cache, t + 1);
        __m512i *dst = vi + (size_t)(t / 2) * (2 * nq);
        for (int c = 0; c < nq; c++) {
            const __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * c));
            const __m512i b = _mm512_loadu_si512((const void *)(v1 + 32 * c));
            dst[2 * c] = _mm512_unpacklo_epi16(a, b);
            dst[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
    }
#undef ROW
}

/* RB query rows (row r: sequence rows[r] / group, head h * group + rows[r] % group) of kv
 * head h over the repacked prefix; RB * D == 256 keeps the accumulators in registers */
static inline __attribute__((always_inline)) void prefix_rows(
    const uint16_t *q, int heads, int group, int h, const int *rows, int nrows,
    const uint32_t *kt, const __m512i *vi, int prefix_len, float scale, float softcap,
    float *state, const int D, const int RB) {
    const int half = D / 2, nv = D / 16;
    const uint32_t *qp[16];
    __m512 acc[16][16];
    float m[16], l[16];
    __attribute__((aligned(64))) float s[16][PREFIX_CHUNK];
    __attribute__((aligned(64))) uint32_t p[16][PREFIX_CHUNK / 2];
    for (int r = 0; r < RB; r++) {
        const int row = rows[r < nrows ? r : 0];
        qp[r] = (const uint32_t *)(q + ((size_t)(row / group) * heads + h * group + row % group) * D);
        for (int c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int start = 0; start < prefix_len; start += PREFIX_CHUNK) {
        const int n = prefix_len - start < PREFIX_CHUNK ? prefix_len - start : PREFIX_CHUNK;
        /* scores: 16 keys per vector, no horizontal sums */
        for (int b = 0; b < n / 16; b++) {
            const uint32_t *kb = kt + (size_t)(start / 16 + b) * half * 16;
            __m512 sc[16];
            for (int r = 0; r < RB; r++) sc[r] = _mm512_setzero_ps();
            for (int c = 0; c < half; c++) {
                const __m512bh kv = (__m512bh)_mm512_load_si512((const void *)(kb + 16 * c));
                for (int r = 0; r < RB; r++)
                    sc[r] = _mm512_dpbf16_ps(sc[r], (__m512bh)_mm512_set1_epi32((int)qp[r][c]), kv);
            }
            for (int r = 0; r < RB; r++) {
                __m512 x = _mm512_mul_ps(sc[r], vscale);
                if (softcap > 0.0f) x = softcap16(x, softcap);
                _mm512_store_ps(s[r] + 16 * b, x);
            }
        }
        /* online softmax over the chunk; weights rounded to bf16 pairs for p.v */
        for (int r = 0; r < RB; r++) {
            __m512 mx = _mm512_load_ps(s[r]);
            for (int b = 1; b < n / 16; b++) mx = _mm512_max_ps(mx, _mm512_load_ps(s[r] + 16 * b));
            const float chunk_max = _mm512_reduce_max_ps(mx);
            const float new_m = chunk_max > m[r] ? chunk_max : m[r];
            const float rescale = expf(m[r] - new_m);
            const __m512 vm = _mm512_set1_ps(new_m);
            __m512 sum = _mm512_setzero_ps();
            for (int b = 0; b < n / 16; b++) {
                const __m256bh eb =
                    _mm512_cvtneps_pbh(exp16(_mm512_sub_ps(_mm512_load_ps(s[r] + 16 * b), vm)));
                _mm256_store_si256((__m256i *)(p[r] + 8 * b), (__m256i)eb);
                sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(eb));
            }
            l[r] = l[r] * rescale + _mm512_reduce_add_ps(sum);
            m[r] = new_m;
            if (rescale != 1.0f)
                for (int c = 0; c < nv; c++)
                    acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(rescale));
        }
        /* p.v: two keys per step, their values pre-interleaved */
        for (int t = 0; t < n / 2; t++) {
            const __m512i *vt = vi + (size_t)(start / 2 + t) * nv;
            for (int r = 0; r < RB; r++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[r][t]);
                for (int c = 0; c < nv; c++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, (__m512bh)_mm512_load_si512(vt + c));
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        const int row = rows[r];
        float *st = state + ((size_t)(row / group) * heads + h * group + row % group) * (D + 2);
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(st + 16 * c, acc[r][c]);
        st[D] = m[r];
        st[D + 1] = l[r];
    }
}
#endif

#define IDENTITY(x) (x)
DEFINE_TASK(task_bf16, uint16_t, uint16_t, bf16_to_f32, bf16_to_f32, f32_to_bf16, 0)
DEFINE_TASK(task_f32, float, float, IDENTITY, IDENTITY, IDENTITY, 0)
#define I8_TO_F32(x) ((float)(x))
DEFINE_TASK(task_i8_bf16, uint16_t, int8_t, bf16_to_f32, I8_TO_F32, f32_to_bf16, 1)
DEFINE_TASK(task_i8_f32, float, int8_t, IDENTITY, I8_TO_F32, IDENTITY, 1)

/* q, out: [batch, kv_heads * group, d]; page_tables: [batch, max_pages]; seq_lens: [batch].
 * window > 0: each query attends only its sequence's last `window` keys; softcap > 0: scores
 * become softcap * tanh(score / softcap) before the softmax.
 * Returns 0, or -1 if a size is beyond the kernel's fixed buffers (the caller falls back). */
#define DEFINE_ENTRY(NAME, T, TASK, FAST, FAST_TASK)                                         \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *page_tables,     \
             const int32_t *seq_lens, int batch, int max_pages, int kv_heads, int group,     \
             int page_size, int d, float scale, int window, float softcap, int num_threads,  \
             T *out, const float *state, int skip) {                                         \
        if (group > MAX_GROUP || d > MAX_HEAD_DIM || page_size > MAX_PAGE) return -1;        \
        /* a shared-prefix state (see paged_decode_prefix_bf16) needs the fast path */       \
        if ((state != NULL || skip != 0) && (!FAST(d) || skip % page_size != 0)) return -2;  \
        /* ... and every key of the prefix inside every sequence's window */                 \
        if (skip != 0 && window > 0)                                                         \
            for (int b = 0; b < batch; b++)                                                  \
                if (seq_lens[b] > window) return -3;                                         \
        const int heads = kv_heads * group;                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int task = 0; task < batch * kv_heads; task++) {                                \
            const int b = task / kv_heads, h = task % kv_heads;                              \
            const T *qb = q + (size_t)b * heads * d;                                         \
            T *ob = out + (size_t)b * heads * d;                                             \
            const int32_t *pages = page_tables + (size_t)b * max_pages;                      \
            const int32_t lo = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0; \
            if (FAST(d))                                                                     \
                FAST_TASK(qb, k_cache, v_cache, pages + skip / page_size, seq_lens[b] - skip, \
                          kv_heads, h, group, page_size, d, scale, lo, softcap,              \
                          state ? state + (size_t)b * heads * (d + 2) : NULL, ob);           \
            else if (d == 64)                                                                \
                TASK(qb, k_cache, v_cache, NULL, NULL, pages, seq_lens[b], kv_heads, h, group, \
                     page_size, 64, scale, lo, softcap, ob);                                 \
            else if (d == 128)                                                               \
                TASK(qb, k_cache, v_cache, NULL, NULL, pages, seq_lens[b], kv_heads, h, group, \
                     page_size, 128, scale, lo, softcap, ob);                                \
            else                                                                             \
                TASK(qb, k_cache, v_cache, NULL, NULL, pages, seq_lens[b], kv_heads, h, group, \
                     page_size, d, scale, lo, softcap, ob);                                  \
        }                                                                                    \
        return 0;                                                                            \
    }

#define NEVER(d) 0
#define NO_FAST_TASK(...) ((void)0)
#ifdef HAVE_AVX512_BF16
#define AVX512_D(d) ((d) % 32 == 0)
/* group and head_dim as compile-time constants for the common shapes, so that the
 * accumulators live in registers */
#define AVX512_CASE(G, D)                                                                    \
    task_bf16_avx512(q, k, v, pg, n, kvh, h, G, ps, D, sc, lo, cap, st, o)
#define AVX512_GROUPS(D)                                                                     \
    switch (g) {                                                                             \
    case 1: AVX512_CASE(1, D); break;                                                        \
    case 2: AVX512_CASE(2, D); break;                                                        \
    case 3: AVX512_CASE(3, D); break;                                                        \
    case 4: AVX512_CASE(4, D); break;                                                        \
    case 5: AVX512_CASE(5, D); break;                                                        \
    case 6: AVX512_CASE(6, D); break;                                                        \
    case 7: AVX512_CASE(7, D); break;                                                        \
    case 8: AVX512_CASE(8, D); break;                                                        \
    default: AVX512_CASE(g, D); break;                                                       \
    }
static void task_bf16_avx512_dispatch(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                      const int32_t *pg, int32_t n, int kvh, int h, int g,
                                      int ps, int d, float sc, int32_t lo, float cap,
                                      const float *st, uint16_t *o) {
    if (d == 64) {
        AVX512_GROUPS(64)
    } else if (d == 128) {
        AVX512_GROUPS(128)
    } else if (d == 256) { /* Gemma 3 */
        AVX512_GROUPS(256)
    } else {
        AVX512_CASE(g, d);
    }
}
#define AVX512_TASK task_bf16_avx512_dispatch
DEFINE_ENTRY(paged_decode_bf16, uint16_t, task_bf16, AVX512_D, AVX512_TASK)
#else
DEFINE_ENTRY(paged_decode_bf16, uint16_t, task_bf16, NEVER, NO_FAST_TASK)
#endif
DEFINE_ENTRY(paged_decode_f32, float, task_f32, NEVER, NO_FAST_TASK)


/* As paged_decode_bf16/f32 over an int8 cache (no shared-prefix pass). Returns 0, or -1 if
 * a size is beyond the kernel's fixed buffers. */
#define DEFINE_ENTRY_I8(NAME, T, TASK)                                                        \
    int NAME(const T *q, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale, \
             const float *v_scale, const int32_t *page_tables, const int32_t *seq_lens,      \
             int batch, int max_pages, int kv_heads, int group, int page_size, int d,        \
             float scale, int window, float softcap, int num_threads, T *out) {              \
        if (group > MAX_GROUP || d > MAX_HEAD_DIM || page_size > MAX_PAGE) return -1;        \
        const int heads = kv_heads * group;                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int task = 0; task < batch * kv_heads; task++) {                                \
            const int b = task / kv_heads, h = task % kv_heads;                              \
            const T *qb = q + (size_t)b * heads * d;                                         \
            T *ob = out + (size_t)b * heads * d;                                             \
            const int32_t *pages = page_tables + (size_t)b * max_pages;                      \
            const int32_t lo = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0; \
            if (d == 64)                                                                     \
                TASK(qb, k_cache, v_cache, k_scale, v_scale, pages, seq_lens[b], kv_heads,   \
                     h, group, page_size, 64, scale, lo, softcap, ob);                       \
            else if (d == 128)                                                               \
                TASK(qb, k_cache, v_cache, k_scale, v_scale, pages, seq_lens[b], kv_heads,   \
                     h, group, page_size, 128, scale, lo, softcap, ob);                      \
            else                                                                             \
                TASK(qb, k_cache, v_cache, k_scale, v_scale, pages, seq_lens[b], kv_heads,   \
                     h, group, page_size, d, scale, lo, softcap, ob);                        \
        }                                                                                    \
        return 0;                                                                            \
    }

DEFINE_ENTRY_I8(paged_decode_i8_bf16, uint16_t, task_i8_bf16)
DEFINE_ENTRY_I8(paged_decode_i8_f32, float, task_i8_f32)

#ifdef HAVE_AVX512_BF16
/* Part one of a shared-prefix decode: the queries q [batch, kv_heads * group, d] of every
 * sequence attend the first prefix_len keys, which all of them hold in the same `pages`;
 * writes state [batch, kv_heads * group, d + 2] (acc, m, l) for paged_decode_bf16's `state`
 * with skip = prefix_len. scratch: kv_heads * prefix_len * d * 2 bf16, 64-byte aligned.
 * Returns 0, or -1 for shapes it does not handle (prefix_len a multiple of 16 and of the
 * page size, d 64 or 128, group <= MAX_GROUP). */
int paged_decode_prefix_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *pages, int prefix_len, int batch, int kv_heads,
                             int group, int page_size, int d, float scale, float softcap,
                             int num_threads, float *state, void *scratch) {
    if ((d != 64 && d != 128) || group > MAX_GROUP || prefix_len % 16 != 0 ||
        prefix_len % page_size != 0 || prefix_len <= 0 || ((uintptr_t)scratch & 63) != 0)
        return -1;
    const int heads = kv_heads * group, rb = 256 / d, nrows = batch * group;
    const size_t per_head = (size_t)prefix_len * d; /* bf16 elements per head, K or V */
    uint16_t *base = (uint16_t *)scratch;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        _Pragma("omp for schedule(static)")
        for (int h = 0; h < kv_heads; h++)
            repack_prefix(k_cache, v_cache, pages, prefix_len, kv_heads, h, page_size, d,
                          (uint32_t *)(base + 2 * h * per_head),
                          (__m512i *)(base + (2 * h + 1) * per_head));
        const int blocks = (nrows + rb - 1) / rb;
        _Pragma("omp for schedule(dynamic, 1)")
        for (int task = 0; task < kv_heads * blocks; task++) {
            const int h = task / blocks, first = (task % blocks) * rb;
            int rows[16];
            const int n = nrows - first < rb ? nrows - first : rb;
            for (int r = 0; r < n; r++) rows[r] = first + r;
            const uint32_t *kt = (const uint32_t *)(base + 2 * h * per_head);
            const __m512i *vi = (const __m512i *)(base + (2 * h + 1) * per_head);
            if (d == 64)
                prefix_rows(q, heads, group, h, rows, n, kt, vi, prefix_len, scale, softcap, state, 64, 4);
            else
                prefix_rows(q, heads, group, h, rows, n, kt, vi, prefix_len, scale, softcap, state, 128,
                            2);
        }
    }
    return 0;
}
#endif

/* 1 when the bfloat16 entry uses the AVX-512 BF16 path (for tests and start-up logs) */
int paged_decode_has_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
