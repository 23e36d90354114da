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

/* One task: the `group` query heads that share kv head `h` of sequence `b`. */
#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                     \
    static inline __attribute__((always_inline)) void NAME(                                 \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *pages,               \
        int32_t seq_len, int kv_heads, int h, int group, int page_size, int d, float scale, \
        T *out) {                                                                           \
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
        for (int p = 0; p * page_size < seq_len; p++) {                                     \
            const size_t base = (size_t)pages[p] * page_stride + (size_t)h * page_size * d; \
            const T *kp = k_cache + base, *vp = v_cache + base;                             \
            int n = seq_len - p * page_size;                                                \
            if (n > page_size) n = page_size;                                               \
            for (int t = 0; t < n; t++) {                                                   \
                const T *kr = kp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD(kr[i]);                            \
                for (int g = 0; g < group; g++) {                                           \
                    float dot = 0.0f;                                                       \
                    for (int i = 0; i < d; i++) dot += qf[g][i] * kf[i];                    \
                    s[g][t] = dot;                                                          \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < group; g++) {                                               \
                float page_max = s[g][0];                                                   \
                for (int t = 1; t < n; t++) page_max = s[g][t] > page_max ? s[g][t] : page_max; \
                const float new_m = page_max > m[g] ? page_max : m[g];                      \
                const float rescale = expf(m[g] - new_m);                                   \
                l[g] *= rescale;                                                            \
                for (int i = 0; i < d; i++) acc[g][i] *= rescale;                           \
                for (int t = 0; t < n; t++) {                                               \
                    s[g][t] = expf(s[g][t] - new_m);                                        \
                    l[g] += s[g][t];                                                        \
                }                                                                           \
                m[g] = new_m;                                                               \
            }                                                                               \
            for (int t = 0; t < n; t++) {                                                   \
                const T *vr = vp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD(vr[i]);                            \
                for (int g = 0; g < group; g++) {                                           \
                    const float w = s[g][t];                                                \
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

static const uint16_t zero_row[MAX_HEAD_DIM]; /* the partner of an odd block's last key */

static inline __attribute__((always_inline)) void task_bf16_avx512(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *pages,
    int32_t seq_len, int kv_heads, int h, int group, int page_size, int d, float scale,
    uint16_t *out) {
    const int nq = d / 32, nv = d / 16; /* bf16 pairs per q row; float32 vectors per row */
    __m512bh qv[MAX_GROUP][MAX_HEAD_DIM / 32];
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16], dots[MAX_GROUP][16];
    float m[MAX_GROUP], l[MAX_GROUP];
    uint32_t pp[MAX_GROUP][8]; /* this block's softmax weights as bf16 pairs (keys 2i, 2i+1) */
    for (int g = 0; g < group; g++) {
        const uint16_t *qr = q + (size_t)(h * group + g) * d;
        for (int c = 0; c < nq; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qr + 32 * c));
        for (int c = 0; c < nv; c++) acc[g][c] = _mm512_setzero_ps();
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const size_t page_stride = (size_t)kv_heads * page_size * d;
    int page = 0, off = 0; /* position of the next key whose rows are located */
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
    LOCATE(rows[0], 0);
    for (int start = 0, parity = 0; start < seq_len; start += 16, parity ^= 1) {
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
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                                _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(scale)));
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
#endif

#define IDENTITY(x) (x)
DEFINE_TASK(task_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_TASK(task_f32, float, IDENTITY, IDENTITY)

/* q, out: [batch, kv_heads * group, d]; page_tables: [batch, max_pages]; seq_lens: [batch].
 * Returns 0, or -1 if a size is beyond the kernel's fixed buffers (the caller falls back). */
#define DEFINE_ENTRY(NAME, T, TASK, FAST, FAST_TASK)                                                          \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *page_tables,     \
             const int32_t *seq_lens, int batch, int max_pages, int kv_heads, int group,     \
             int page_size, int d, float scale, int num_threads, T *out) {                   \
        if (group > MAX_GROUP || d > MAX_HEAD_DIM || page_size > MAX_PAGE) return -1;        \
        const int heads = kv_heads * group;                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int task = 0; task < batch * kv_heads; task++) {                                \
            const int b = task / kv_heads, h = task % kv_heads;                              \
            const T *qb = q + (size_t)b * heads * d;                                         \
            T *ob = out + (size_t)b * heads * d;                                             \
            const int32_t *pages = page_tables + (size_t)b * max_pages;                      \
            if (FAST(d))                                                                     \
                FAST_TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,      \
                          page_size, d, scale, ob);                                          \
            else if (d == 64)                                                                \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, 64, scale, ob);                                              \
            else if (d == 128)                                                               \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, 128, scale, ob);                                             \
            else                                                                             \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, d, scale, ob);                                               \
        }                                                                                    \
        return 0;                                                                            \
    }

#define NEVER(d) 0
#ifdef HAVE_AVX512_BF16
#define AVX512_D(d) ((d) % 32 == 0)
/* group and head_dim as compile-time constants for the common shapes, so that the
 * accumulators live in registers */
#define AVX512_CASE(G, D)                                                                    \
    task_bf16_avx512(q, k, v, pg, n, kvh, h, G, ps, D, sc, o)
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
                                      int ps, int d, float sc, uint16_t *o) {
    if (d == 64) {
        AVX512_GROUPS(64)
    } else if (d == 128) {
        AVX512_GROUPS(128)
    } else {
        AVX512_CASE(g, d);
    }
}
#define AVX512_TASK task_bf16_avx512_dispatch
DEFINE_ENTRY(paged_decode_bf16, uint16_t, task_bf16, AVX512_D, AVX512_TASK)
#else
DEFINE_ENTRY(paged_decode_bf16, uint16_t, task_bf16, NEVER, task_bf16)
#endif
DEFINE_ENTRY(paged_decode_f32, float, task_f32, NEVER, task_f32)

/* 1 when the bfloat16 entry uses the AVX-512 BF16 path (for tests and start-up logs) */
int paged_decode_has_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}
