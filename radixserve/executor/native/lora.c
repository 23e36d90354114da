/* LoRA adapters' low-rank products over a step's rows grouped by adapter (a segmented
 * gather-GEMV, Punica's SGMV): y[row] += (A_s x[row]) Bt_s for each segment s of rows on one
 * adapter, every segment of the step in one call and one parallel region.
 *
 * desc (the step's, built by executor/lora.py): [nseg, then per segment: first row, end
 * row, adapter table*]. An adapter table is [slots][3] int64: (A*, Bt*, R) per projection
 * slot (layer * 4 + group); A* 0: the adapter does not touch that projection. A is
 * [R, in] bfloat16, row-major. Bt (B transposed, [R, out]) is held blocked for this kernel:
 * [ceil(out / 32) blocks][ceil(R / 2) pairs of k][32 outputs][2], element (k, o) at
 * block o / 32, pair k / 2, output o % 32, lane k % 2; zero-padded past R and out. Rows
 * are the step's; x and y hold rows row0 .. row0 + nrows - 1 of it (the op-by-op path's
 * MLP runs in row blocks), rows x_stride and y_stride elements apart.
 *
 * What a row computes, as PyTorch's bfloat16 ``y.addmm_(x @ A^T, Bt)`` does (the path of
 * long segments): h = A x summed in float32 and rounded to bfloat16, then y + h Bt summed in
 * float32 and rounded once to bfloat16. Each row is computed on its own, in an order that
 * does not depend on the other rows of the step. Work is split over (segment, k) for the
 * shrink and (segment, 32 outputs) for the expand, so a step of one row per adapter keeps
 * every thread busy; each item takes up to four rows at once, which share its loads.
 * With AVX-512 BF16 the dot products are VDPBF16PS (pairs of bfloat16 products summed in
 * float32); elsewhere plain C the compiler vectorises.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define LORA_BF16_DOT 1
#endif

#define OUT_BLOCK 32
/* an item's share: this many k of one segment (shrink), this many blocks of outputs
 * (expand): contiguous runs of weights long enough for the prefetchers */
#define K_PER_ITEM 8
#define BLOCKS_PER_ITEM 4

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* to nearest even; any NaN to its one NaN */
    if (f != f) return 0x7FC0u;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* h[j * h_stride] = bf16(A[k] . x[j]) for m (1-4) rows j */
static inline __attribute__((always_inline)) void shrink_rows(const uint16_t *a,
                                                              const uint16_t *x,
                                                              int64_t x_stride, int64_t in,
                                                              int m, uint16_t *h,
                                                              int64_t h_stride) {
#ifdef LORA_BF16_DOT
    __m512 c[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int64_t i = 0; i < in; i += 32) {
        const __mmask32 mask = in - i >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (in - i)) - 1u);
        const __m512i av = _mm512_maskz_loadu_epi16(mask, a + i);
        for (int j = 0; j < m; j++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + j * x_stride + i);
            c[j] = _mm512_dpbf16_ps(c[j], (__m512bh)av, (__m512bh)xv);
        }
    }
    for (int j = 0; j < m; j++) h[j * h_stride] = f32_bf16(_mm512_reduce_add_ps(c[j]));
#else
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t i = 0; i < in; i++) {
        const float ai = bf16_f32(a[i]);
        for (int j = 0; j < m; j++) c[j] += ai * bf16_f32(x[j * x_stride + i]);
    }
    for (int j = 0; j < m; j++) h[j * h_stride] = f32_bf16(c[j]);
#endif
}

/* y[j][0 .. width) += h[j] Bt (one block of Bt: pairs * OUT_BLOCK * 2) for m (1-4) rows;
 * h[j] holds 2 * pairs bfloat16 (zero past R) */
static inline __attribute__((always_inline)) void expand_rows(const uint16_t *bt, int64_t pairs,
                                                              const uint16_t *h,
                                                              int64_t h_stride, int m,
                                                              uint16_t *y, int64_t y_stride,
                                                              int64_t width) {
#ifdef LORA_BF16_DOT
    __m512 acc[4][2];
    for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i b0 = _mm512_loadu_si512(bt + p * 2 * OUT_BLOCK);
        const __m512i b1 = _mm512_loadu_si512(bt + p * 2 * OUT_BLOCK + OUT_BLOCK);
        for (int j = 0; j < m; j++) {
            uint32_t pair;
            memcpy(&pair, h + j * h_stride + 2 * p, sizeof pair);
            const __m512i hv = _mm512_set1_epi32((int)pair);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)b0, (__m512bh)hv);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], (__m512bh)b1, (__m512bh)hv);
        }
    }
    for (int j = 0; j < m; j++) {
        float sum[OUT_BLOCK];
        _mm512_storeu_ps(sum, acc[j][0]);
        _mm512_storeu_ps(sum + 16, acc[j][1]);
        uint16_t *yr = y + j * y_stride;
        for (int64_t o = 0; o < width; o++) yr[o] = f32_bf16(bf16_f32(yr[o]) + sum[o]);
    }
#else
    float acc[4][OUT_BLOCK] = {{0}};
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *b = bt + p * 2 * OUT_BLOCK;
        float h0[4], h1[4];
        for (int j = 0; j < m; j++) {
            h0[j] = bf16_f32(h[j * h_stride + 2 * p]);
            h1[j] = bf16_f32(h[j * h_stride + 2 * p + 1]);
        }
        for (int o = 0; o < OUT_BLOCK; o++) {
            const float b0 = bf16_f32(b[2 * o]), b1 = bf16_f32(b[2 * o + 1]);
            for (int j = 0; j < m; j++) acc[j][o] += h0[j] * b0 + h1[j] * b1;
        }
    }
    for (int j = 0; j < m; j++) {
        uint16_t *yr = y + j * y_stride;
        for (int64_t o = 0; o < width; o++) yr[o] = f32_bf16(bf16_f32(yr[o]) + acc[j][o]);
    }
#endif
}

/* `call` with M the constant m (1-4): each row count its own inlined copy */
#define BY_ROWS(m, call)                                                                      \
    switch (m) {                                                                              \
    case 4: {                                                                                 \
        const int M = 4;                                                                      \
        call;                                                                                 \
    } break;                                                                                  \
    case 3: {                                                                                 \
        const int M = 3;                                                                      \
        call;                                                                                 \
    } break;                                                                                  \
    case 2: {                                                                                 \
        const int M = 2;                                                                      \
        call;                                                                                 \
    } break;                                                                                  \
    default: {                                                                                \
        const int M = 1;                                                                      \
        call;                                                                                 \
    } break;                                                                                  \
    }

typedef struct {
    const uint16_t *a, *bt;
    int64_t r, pairs;  /* rank; its pairs of k (ceil(r / 2)) */
    int64_t lo, hi;    /* rows lo .. hi-1 of x / y (made relative to row0) */
    int64_t h;         /* its rows' first element in the h scratch (rows 2 * pairs apart) */
} segment;

/* Returns 0, or 1 when the scratch could not be had (nothing added then). */
int lora_apply_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride,
                    int64_t in, int64_t out, int64_t slot, const int64_t *desc, int64_t row0,
                    int64_t nrows, int threads) {
    const int64_t nseg = desc[0];
    segment stack_segs[64];
    segment *segs = nseg <= 64 ? stack_segs : malloc((size_t)nseg * sizeof(segment));
    if (segs == NULL) return 1;
    int64_t used = 0, elems = 0, shrink = 0, expand = 0;
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
    const int64_t block_items = (blocks + BLOCKS_PER_ITEM - 1) / BLOCKS_PER_ITEM;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t *d = desc + 1 + 3 * s;
        const int64_t *entry = (const int64_t *)(intptr_t)d[2] + 3 * slot;
        int64_t lo = d[0] - row0, hi = d[1] - row0;
        if (lo < 0) lo = 0;
        if (hi > nrows) hi = nrows;
        if (entry[0] == 0 || lo >= hi) continue;
        segment *g = &segs[used++];
        g->a = (const uint16_t *)(intptr_t)entry[0];
        g->bt = (const uint16_t *)(intptr_t)entry[1];
        g->r = entry[2];
        g->pairs = (g->r + 1) / 2;
        g->lo = lo;
        g->hi = hi;
        g->h = elems;
        elems += (hi - lo) * 2 * g->pairs;
        shrink += (g->r + K_PER_ITEM - 1) / K_PER_ITEM;
        expand += block_items;
    }
    if (used == 0) {
        if (segs != stack_segs) free(segs);
        return 0;
    }
    uint16_t *h = calloc((size_t)elems, sizeof(uint16_t)); /* (zero: the pad of odd ranks) */
    if (h == NULL) {
        if (segs != stack_segs) free(segs);
        return 1;
    }
    const int nt = threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(nt)
    {
        /* shrink: h[row][k] = A[k] . x[row], one (segment, K_PER_ITEM k) an item */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink; item++) {
            int64_t chunk = item, s = 0;
            while (chunk >= (segs[s].r + K_PER_ITEM - 1) / K_PER_ITEM)
                chunk -= (segs[s++].r + K_PER_ITEM - 1) / K_PER_ITEM;
            const segment *g = &segs[s];
            const int64_t stride = 2 * g->pairs, k0 = chunk * K_PER_ITEM;
            const int64_t k1 = k0 + K_PER_ITEM < g->r ? k0 + K_PER_ITEM : g->r;
            for (int64_t k = k0; k < k1; k++)
                for (int64_t row = g->lo; row < g->hi; row += 4) {
                    const int m = g->hi - row < 4 ? (int)(g->hi - row) : 4;
                    uint16_t *hk = h + g->h + (row - g->lo) * stride + k;
                    BY_ROWS(m, shrink_rows(g->a + k * in, x + row * x_stride, x_stride, in, M,
                                           hk, stride))
                }
        }
        /* expand: y[row][o] += sum_k h[row][k] Bt[k][o], one (segment, BLOCKS_PER_ITEM
         * blocks of outputs) an item */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < expand; item++) {
            const segment *g = &segs[item / block_items];
            const int64_t b0 = (item % block_items) * BLOCKS_PER_ITEM;
            const int64_t b1 = b0 + BLOCKS_PER_ITEM < blocks ? b0 + BLOCKS_PER_ITEM : blocks;
            const int64_t stride = 2 * g->pairs;
            for (int64_t blk = b0; blk < b1; blk++) {
                const int64_t o0 = blk * OUT_BLOCK;
                const int64_t width = o0 + OUT_BLOCK < out ? OUT_BLOCK : out - o0;
                const uint16_t *bt = g->bt + blk * g->pairs * 2 * OUT_BLOCK;
                for (int64_t row = g->lo; row < g->hi; row += 4) {
                    const int m = g->hi - row < 4 ? (int)(g->hi - row) : 4;
                    const uint16_t *hr = h + g->h + (row - g->lo) * stride;
                    BY_ROWS(m, expand_rows(bt, g->pairs, hr, stride, M,
                                           y + row * y_stride + o0, y_stride, width))
                }
            }
        }
    }
    free(h);
    if (segs != stack_segs) free(segs);
    return 0;
}
