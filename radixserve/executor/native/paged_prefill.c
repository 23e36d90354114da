/* Chunked-prefill attention for CPU: a chunk of queries per sequence attends to every cached
 * key before it and causally within the chunk. K/V are read in place from the page-major
 * cache [num_pages, kv_heads, page_size, head_dim]: no gather of the context, no mask tensor.
 *
 * Flash-style: one task is (sequence, kv head, block of queries). Its rows are the block's
 * queries times the `group` query heads sharing that kv head (row m = query m / group, head
 * m % group), so one pass over the kv head's keys serves all of them. Keys are visited in
 * tiles of NT positions with an online softmax (running max and sum per row, float32); a
 * tile is masked only where it crosses a row's own position.
 *
 * Scores are kept transposed, S[key][row], so the softmax runs along rows as plain vector
 * ops and each key row of K is read straight from its page. With AVX512-BF16 the two
 * products (Q K^T and P V) are vdpbf16ps on bf16 pairs; otherwise portable loops in float32
 * that the compiler vectorises (also the float32 path). Built and loaded by __init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NT 32         /* keys per tile (a multiple of 8) */
#define ROWS 96       /* target rows (queries x group) per task */
#define MAX_M 96      /* rows per task, rounded up to 16: ROWS / group * group <= ROWS */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define LOG2E 1.4426950408889634f

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

/* Per-thread scratch, sized for MAX_M rows and head size d. */
typedef struct {
    float *q;      /* [d][Mp] float32 rows (portable) or [d/2][Mp] bf16 pairs (fast) */
    float *o;      /* [d][Mp] output accumulator, transposed */
    float *s;      /* [NT][Mp] scores, then probabilities */
    uint32_t *pp;  /* [NT/2][Mp] probabilities as bf16 pairs (fast path) */
    uint32_t *vp;  /* [NT/2][d] values as bf16 pairs (fast path) */
    float *row_max, *row_sum, *alpha;
    int32_t *qpos; /* [Mp] position of each row's query */
} Work;

/* ---- online softmax over one tile: s[n][m] for n < nk -------------------------------------
 * On return s holds p = exp(s * scale - new max) (0 for masked keys and rows nk.. of the tile
 * up to an even count), row_sum and row_max are updated and alpha[m] is the factor the
 * accumulator must be rescaled by. Returns whether any alpha differs from 1. */
#if defined(__AVX512F__)
static inline __m512 exp2_ps(__m512 x) { /* 2^x, exactly 0 below -126 (and for -inf) */
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

static int softmax_tile(Work *w, int Mp, int nk, int k0, int masked, float scale_log2,
                        int window) {
    const __m512 c = _mm512_set1_ps(scale_log2), ninf = _mm512_set1_ps(-INFINITY);
    const int nk2 = (nk + 1) & ~1;
    int rescale = 0;
    for (int mv = 0; mv < Mp; mv += 16) {
        const __m512i qpos = _mm512_loadu_si512(w->qpos + mv);
        __m512 tmax = ninf;
        /* the max of the raw scores (scale > 0 commutes with it); masked keys become -inf */
        for (int n = 0; n < nk; n++) {
            float *row = w->s + (size_t)n * Mp + mv;
            __m512 s = _mm512_loadu_ps(row);
            if (masked) {
                __mmask16 beyond = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(k0 + n), qpos);
                if (window > 0) /* key k0 + n is at or before qpos - window */
                    beyond |= _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(k0 + n + window));
                s = _mm512_mask_mov_ps(s, beyond, ninf);
                _mm512_storeu_ps(row, s);
            }
            tmax = _mm512_max_ps(tmax, s);
        }
        const __m512 old = _mm512_loadu_ps(w->row_max + mv); /* in scaled units */
        const __m512 new_max = _mm512_max_ps(old, _mm512_mul_ps(tmax, c));
        if (_mm512_cmp_ps_mask(new_max, old, _CMP_NEQ_UQ)) rescale = 1;
        const __m512 alpha = exp2_ps(_mm512_sub_ps(old, new_max));
        __m512 sum = _mm512_setzero_ps();
        for (int n = 0; n < nk; n++) {
            float *row = w->s + (size_t)n * Mp + mv;
            const __m512 p = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(row), c, new_max));
            _mm512_storeu_ps(row, p);
            sum = _mm512_add_ps(sum, p);
        }
        for (int n = nk; n < nk2; n++) _mm512_storeu_ps(w->s + (size_t)n * Mp + mv, _mm512_setzero_ps());
        _mm512_storeu_ps(w->row_sum + mv,
                         _mm512_fmadd_ps(_mm512_loadu_ps(w->row_sum + mv), alpha, sum));
        _mm512_storeu_ps(w->row_max + mv, new_max);
        _mm512_storeu_ps(w->alpha + mv, alpha);
    }
    return rescale;
}
#else
static int softmax_tile(Work *w, int Mp, int nk, int k0, int masked, float scale_log2,
                        int window) {
    const int nk2 = (nk + 1) & ~1;
    float tmax[MAX_M];
    for (int m = 0; m < Mp; m++) tmax[m] = -INFINITY;
    for (int n = 0; n < nk; n++) {
        float *row = w->s + (size_t)n * Mp;
        for (int m = 0; m < Mp; m++) {
            float s = row[m] * scale_log2;
            if (masked && (k0 + n > w->qpos[m] || (window > 0 && k0 + n <= w->qpos[m] - window)))
                s = -INFINITY;
            row[m] = s;
            tmax[m] = s > tmax[m] ? s : tmax[m];
        }
    }
    int rescale = 0;
    for (int m = 0; m < Mp; m++) {
        const float old = w->row_max[m];
        const float new_max = tmax[m] > old ? tmax[m] : old;
        rescale |= new_max != old;
        w->alpha[m] = old == -INFINITY ? 0.0f : exp2f(old - new_max);
        w->row_sum[m] *= w->alpha[m];
        w->row_max[m] = new_max;
    }
    for (int n = 0; n < nk; n++) {
        float *row = w->s + (size_t)n * Mp;
        for (int m = 0; m < Mp; m++) {
            const float p = row[m] == -INFINITY ? 0.0f : exp2f(row[m] - w->row_max[m]);
            row[m] = p;
            w->row_sum[m] += p;
        }
    }
    for (int n = nk; n < nk2; n++) memset(w->s + (size_t)n * Mp, 0, sizeof(float) * Mp);
    return rescale;
}
#endif

/* soft-capped scores: s = cap * tanh(s * scale / cap) / scale (the softmax scales them) */
static void softcap_tile(Work *w, int Mp, int nk, float scale, float cap) {
    for (int n = 0; n < nk; n++) {
        float *row = w->s + (size_t)n * Mp;
        for (int m = 0; m < Mp; m++) row[m] = cap * tanhf(row[m] * scale / cap) / scale;
    }
}

static void rescale_acc(Work *w, int Mp, int d) {
    for (int j = 0; j < d; j++) {
        float *o = w->o + (size_t)j * Mp;
        for (int m = 0; m < Mp; m++) o[m] *= w->alpha[m];
    }
}

/* ---- portable products (float32 arithmetic; T is float or bf16) --------------------------- */
#define DEFINE_PORTABLE(SUFFIX, T, LOAD)                                                       \
    static void load_q_##SUFFIX(Work *w, const T *const *qrow, int M, int Mp, int d) {         \
        for (int i = 0; i < d; i++) {                                                          \
            float *dst = w->q + (size_t)i * Mp;                                                \
            for (int m = 0; m < M; m++) dst[m] = LOAD(qrow[m][i]);                             \
            for (int m = M; m < Mp; m++) dst[m] = 0.0f;                                        \
        }                                                                                      \
    }                                                                                          \
    static void qk_##SUFFIX(Work *w, const T *const *krow, int nk, int Mp, int d) {            \
        for (int n = 0; n < nk; n++) {                                                         \
            float *s = w->s + (size_t)n * Mp;                                                  \
            for (int m = 0; m < Mp; m++) s[m] = 0.0f;                                          \
            for (int i = 0; i < d; i++) {                                                      \
                const float kv = LOAD(krow[n][i]);                                             \
                const float *qi = w->q + (size_t)i * Mp;                                       \
                for (int m = 0; m < Mp; m++) s[m] += qi[m] * kv;                               \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void pv_##SUFFIX(Work *w, const T *const *vrow, int nk, int Mp, int d) {            \
        for (int n = 0; n < nk; n++) {                                                         \
            const float *p = w->s + (size_t)n * Mp;                                            \
            for (int j = 0; j < d; j++) {                                                      \
                const float vv = LOAD(vrow[n][j]);                                             \
                float *o = w->o + (size_t)j * Mp;                                              \
                for (int m = 0; m < Mp; m++) o[m] += p[m] * vv;                                \
            }                                                                                  \
        }                                                                                      \
    }

#define IDENTITY(x) (x)
DEFINE_PORTABLE(f32, float, IDENTITY)
DEFINE_PORTABLE(bf16, uint16_t, bf16_to_f32)

/* ---- AVX512-BF16 products: bf16 pairs, float32 accumulation ------------------------------ */
#if defined(__AVX512BF16__)
#define FAST_BF16 1
static void load_q_fast(Work *w, const uint16_t *const *qrow, int M, int Mp, int d) {
    uint32_t *qp = (uint32_t *)w->q; /* [d/2][Mp]: (q[m][2p], q[m][2p+1]) */
    for (int p = 0; p < d / 2; p++) {
        uint32_t *dst = qp + (size_t)p * Mp;
        for (int m = 0; m < M; m++) memcpy(dst + m, qrow[m] + 2 * p, 4);
        for (int m = M; m < Mp; m++) dst[m] = 0;
    }
}

/* s[n][m] = sum_i q[m][i] k[n][i] for a block of 8 keys x MV (1-3) vectors of 16 rows */
#define QK_BLOCK(MV)                                                                           \
    do {                                                                                       \
        __m512 acc[MV][8];                                                                     \
        for (int a = 0; a < MV; a++)                                                           \
            for (int b = 0; b < 8; b++) acc[a][b] = _mm512_setzero_ps();                       \
        const int32_t *kr[8];                                                                  \
        for (int b = 0; b < 8; b++) kr[b] = (const int32_t *)krow[n0 + b];                     \
        for (int p = 0; p < d / 2; p++) {                                                      \
            __m512bh qv[MV];                                                                   \
            for (int a = 0; a < MV; a++)                                                       \
                qv[a] = (__m512bh)_mm512_loadu_si512(qp + (size_t)p * Mp + mv + 16 * a);       \
            _Pragma("GCC unroll 8") for (int b = 0; b < 8; b++) {                              \
                const __m512bh kb = (__m512bh)_mm512_set1_epi32(kr[b][p]);                     \
                for (int a = 0; a < MV; a++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], qv[a], kb); \
            }                                                                                  \
        }                                                                                      \
        for (int a = 0; a < MV; a++)                                                           \
            for (int b = 0; b < 8; b++)                                                        \
                _mm512_storeu_ps(w->s + (size_t)(n0 + b) * Mp + mv + 16 * a, acc[a][b]);       \
    } while (0)

static void qk_fast(Work *w, const uint16_t *const *krow, int nk, int Mp, int d) {
    /* krow has a multiple of 8 entries (the tail repeats the last key; its rows are ignored) */
    const uint32_t *qp = (const uint32_t *)w->q;
    for (int n0 = 0; n0 < nk; n0 += 8) {
        int mv = 0;
        for (; mv + 48 <= Mp; mv += 48) QK_BLOCK(3);
        for (; mv + 32 <= Mp; mv += 32) QK_BLOCK(2);
        if (mv < Mp) QK_BLOCK(1);
    }
}

/* o[j][m] += sum_n p[n][m] v[n][j] over bf16 pairs of keys, blocks of 8 j x MV vectors */
#define PV_BLOCK(MV)                                                                           \
    do {                                                                                       \
        __m512 acc[MV][8];                                                                     \
        for (int a = 0; a < MV; a++)                                                           \
            for (int b = 0; b < 8; b++)                                                        \
                acc[a][b] = _mm512_loadu_ps(w->o + (size_t)(j0 + b) * Mp + mv + 16 * a);       \
        for (int np = 0; np < npairs; np++) {                                                  \
            __m512bh pv[MV];                                                                   \
            for (int a = 0; a < MV; a++)                                                       \
                pv[a] = (__m512bh)_mm512_loadu_si512(w->pp + (size_t)np * Mp + mv + 16 * a);   \
            const uint32_t *vr = w->vp + (size_t)np * d + j0;                                  \
            _Pragma("GCC unroll 8") for (int b = 0; b < 8; b++) {                              \
                const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vr[b]);                   \
                for (int a = 0; a < MV; a++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], pv[a], vb); \
            }                                                                                  \
        }                                                                                      \
        for (int a = 0; a < MV; a++)                                                           \
            for (int b = 0; b < 8; b++)                                                        \
                _mm512_storeu_ps(w->o + (size_t)(j0 + b) * Mp + mv + 16 * a, acc[a][b]);       \
    } while (0)

static void pv_fast(Work *w, const uint16_t *const *vrow, int nk, int Mp, int d) {
    const int npairs = (nk + 1) / 2;
    /* probabilities: rows 2np and 2np+1 interleaved into pairs (row nk is zero when odd) */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    for (int np = 0; np < npairs; np++)
        for (int m = 0; m < Mp; m += 16) {
            const __m512 a = _mm512_loadu_ps(w->s + (size_t)(2 * np) * Mp + m);
            const __m512 b = _mm512_loadu_ps(w->s + (size_t)(2 * np + 1) * Mp + m);
            const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a in the low half */
            _mm512_storeu_si512(w->pp + (size_t)np * Mp + m, _mm512_permutexvar_epi16(inter, ab));
        }
    /* values: rows 2np and 2np+1 interleaved element by element (a zero row past the end) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int np = 0; np < npairs; np++) {
        const uint16_t *va = vrow[2 * np];
        const int has_b = 2 * np + 1 < nk;
        const uint16_t *vb = vrow[has_b ? 2 * np + 1 : 2 * np];
        uint32_t *dst = w->vp + (size_t)np * d;
        for (int j = 0; j < d; j += 32) {
            const __m512i a = _mm512_loadu_si512(va + j);
            const __m512i b = has_b ? _mm512_loadu_si512(vb + j) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + j, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(dst + j + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
    for (int j0 = 0; j0 < d; j0 += 8) {
        int mv = 0;
        for (; mv + 48 <= Mp; mv += 48) PV_BLOCK(3);
        for (; mv + 32 <= Mp; mv += 32) PV_BLOCK(2);
        if (mv < Mp) PV_BLOCK(1);
    }
}
#else
#define FAST_BF16 0
#endif

/* ---- one task ------------------------------------------------------------------------------ */
typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *page_tables, *q_starts, *q_lens, *seq_lens;
    void *out;
    int64_t q_stride, out_stride; /* elements between consecutive tokens' rows */
    int max_pages, kv_heads, group, page_size, d;
    float scale;
    int window;    /* > 0: a query at p attends keys p - window + 1 .. p */
    float softcap; /* > 0: scores soft-capped */
} Args;

#define DEFINE_TASK(NAME, T, LOAD_Q, QK, PV, STORE)                                            \
    static void NAME(const Args *a, Work *w, int r, int qb0, int nq, int h) {                  \
        const int group = a->group, d = a->d, M = nq * group, Mp = (M + 15) & ~15;             \
        const int q_len = a->q_lens[r], pos0 = a->seq_lens[r] - q_len + qb0;                   \
        const int64_t tok0 = a->q_starts[r] + qb0;                                             \
        const T *qrow[MAX_M];                                                                  \
        for (int m = 0; m < Mp; m++) {                                                         \
            const int qi = m < M ? m / group : nq - 1, g = m < M ? m % group : 0;              \
            qrow[m] = (const T *)a->q + (tok0 + qi) * a->q_stride + (size_t)(h * group + g) * d; \
            w->qpos[m] = pos0 + qi;                                                            \
            w->row_max[m] = -INFINITY;                                                         \
            w->row_sum[m] = 0.0f;                                                              \
        }                                                                                      \
        LOAD_Q(w, qrow, M, Mp, d);                                                             \
        memset(w->o, 0, sizeof(float) * (size_t)d * Mp);                                       \
        const int32_t *pages = a->page_tables + (size_t)r * a->max_pages;                      \
        const size_t head_off = (size_t)h * a->page_size * d;                                  \
        const size_t page_stride = (size_t)a->kv_heads * a->page_size * d;                     \
        const int kv_end = pos0 + nq; /* keys 0 .. last query's position */                   \
        const float scale_log2 = a->scale * LOG2E;                                             \
        const int window = a->window;                                                          \
        /* the first key the block's first query sees (0 without a window) */                 \
        const int kv_start = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;      \
        for (int k0 = kv_start; k0 < kv_end; k0 += NT) {                                       \
            const int nk = kv_end - k0 < NT ? kv_end - k0 : NT;                                \
            const T *krow[NT], *vrow[NT];                                                      \
            for (int n = 0; n < NT; n++) {                                                     \
                const int kp = k0 + (n < nk ? n : nk - 1);                                     \
                const size_t off = (size_t)pages[kp / a->page_size] * page_stride + head_off + \
                                   (size_t)(kp % a->page_size) * d;                            \
                krow[n] = (const T *)a->k_cache + off;                                         \
                vrow[n] = (const T *)a->v_cache + off;                                         \
            }                                                                                  \
            QK(w, krow, nk, Mp, d);                                                            \
            if (a->softcap > 0.0f) softcap_tile(w, Mp, nk, a->scale, a->softcap);              \
            const int masked = k0 + nk - 1 > pos0 || (window > 0 && k0 <= kv_end - 1 - window); \
            if (softmax_tile(w, Mp, nk, k0, masked, scale_log2, window))                       \
                rescale_acc(w, Mp, d);                                                         \
            PV(w, vrow, nk, Mp, d);                                                            \
        }                                                                                      \
        for (int m = 0; m < M; m++) {                                                          \
            T *o = (T *)a->out + (tok0 + m / group) * a->out_stride +                          \
                   (size_t)(h * group + m % group) * d;                                        \
            const float inv = 1.0f / w->row_sum[m];                                            \
            for (int j = 0; j < d; j++) o[j] = STORE(w->o[(size_t)j * Mp + m] * inv);          \
        }                                                                                      \
    }

DEFINE_TASK(task_f32, float, load_q_f32, qk_f32, pv_f32, IDENTITY)
DEFINE_TASK(task_bf16, uint16_t, load_q_bf16, qk_bf16, pv_bf16, f32_to_bf16)
#if FAST_BF16
DEFINE_TASK(task_bf16_fast, uint16_t, load_q_fast, qk_fast, pv_fast, f32_to_bf16)
#endif

typedef void (*TaskFn)(const Args *, Work *, int, int, int, int);

static int run(const Args *a, int batch, int num_threads, TaskFn fn) {
    if (a->group < 1 || a->group > MAX_GROUP || a->d > MAX_HEAD_DIM || a->d % 2) return -1;
    const int qb = ROWS / a->group; /* queries per task */
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)batch + 1));
    if (!first) return -2;
    first[0] = 0;
    for (int r = 0; r < batch; r++)
        first[r + 1] = first[r] + (int64_t)((a->q_lens[r] + qb - 1) / qb) * a->kv_heads;
    const int64_t num_tasks = first[batch];
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t d = (size_t)a->d;
        const size_t floats = 2 * d * MAX_M + (size_t)NT * MAX_M + (NT / 2) * MAX_M +
                              (NT / 2) * d + 4 * MAX_M;
        float *buf = aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        Work w;
        if (buf) {
            w.q = buf;
            w.o = w.q + d * MAX_M;
            w.s = w.o + d * MAX_M;
            w.pp = (uint32_t *)(w.s + (size_t)NT * MAX_M);
            w.vp = w.pp + (NT / 2) * MAX_M;
            w.row_max = (float *)(w.vp + (NT / 2) * d);
            w.row_sum = w.row_max + MAX_M;
            w.alpha = w.row_sum + MAX_M;
            w.qpos = (int32_t *)(w.alpha + MAX_M);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; t++) {
            if (!buf) continue;
            int r = 0;
            while (first[r + 1] <= t) r++; /* batches are small */
            const int64_t local = t - first[r];
            const int blocks = (int)((first[r + 1] - first[r]) / a->kv_heads);
            /* last query block first: it sees the most keys */
            const int block = blocks - 1 - (int)(local / a->kv_heads);
            const int h = (int)(local % a->kv_heads);
            const int qb0 = block * qb;
            const int nq = a->q_lens[r] - qb0 < qb ? a->q_lens[r] - qb0 : qb;
            fn(a, &w, r, qb0, nq, h);
        }
        free(buf);
    }
    free(first);
    return failed ? -2 : 0;
}

/* q: [tokens, >= heads * d] with rows q_stride apart (heads contiguous, d each);
 * out: the same with out_stride; request r's queries are tokens q_starts[r] ..
 * q_starts[r] + q_lens[r] - 1 at positions seq_lens[r] - q_lens[r] .. seq_lens[r] - 1,
 * and its keys 0 .. seq_lens[r] - 1 are already in its pages page_tables[r, :]. window > 0:
 * a query at position p attends keys p - window + 1 .. p only; softcap > 0: scores become
 * softcap * tanh(score / softcap) before the softmax.
 * Returns 0; -1 for shapes beyond the kernel's buffers; -2 when scratch allocation fails. */
#define DEFINE_ENTRY(NAME, T, PICK)                                                           \
    int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                \
             const int32_t *page_tables, int max_pages, const int32_t *q_starts,              \
             const int32_t *q_lens, const int32_t *seq_lens, int batch, int kv_heads,         \
             int group, int page_size, int d, float scale, int window, float softcap,         \
             int num_threads, T *out, int64_t out_stride) {                                   \
        const Args a = {q,        k_cache,   v_cache,  page_tables, q_starts, q_lens,        \
                        seq_lens, out,       q_stride, out_stride,  max_pages, kv_heads,     \
                        group,    page_size, d,        scale,       window,   softcap};      \
        return run(&a, batch, num_threads, PICK);                                             \
    }

DEFINE_ENTRY(paged_prefill_f32, float, task_f32)
#if FAST_BF16
DEFINE_ENTRY(paged_prefill_bf16, uint16_t, (d % 32 == 0 ? task_bf16_fast : task_bf16))
#else
DEFINE_ENTRY(paged_prefill_bf16, uint16_t, task_bf16)
#endif

/* 1 when bf16 caches take the AVX512-BF16 products (head sizes that are multiples of 32). */
int paged_prefill_has_fast_bf16(void) { return FAST_BF16; }
