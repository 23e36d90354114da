/* Group-wise int4 weights in "panels", multiplied without leaving the kernel: a GEMM for a
 * few rows (decode) and a dequantizer to bfloat16 for many (prefill, then oneDNN's GEMM).
 *
 * Layout (executor/quant.py: ``to_panels``), N padded to a multiple of 16, K a multiple of 8:
 *   panels [N/16][K/8][16] uint32: lane j of (block b, octet o) holds output 16 b + j's
 *           codes at inputs 8 o .. 8 o + 7: for u = 0..3, the code at input 8 o + 2 u in
 *           bits 4 u .. 4 u + 3 and the one at 8 o + 2 u + 1 in bits 16 + 4 u .. 19 + 4 u;
 *   sz     [N/16][K/group][2][16] bfloat16: the 16 outputs' scales, then their zeros;
 *   W[n, k] = (q[n, k] - 8) * scale + zero.
 *
 * The GEMM turns an octet's 64 bytes into four vectors of bfloat16 pairs with two integer
 * ops each: lane >> 4 u, then one ternary-logic op keeps the bits 0x000F000F and sets
 * 0x43004300, so each 16-bit half is 0x4300 (bfloat16 128.0) with the code q in its low
 * mantissa bits: the bfloat16 128 + q, exactly. (The previous layout, a byte per pair,
 * needed a widening shuffle and four ops per pair; decode was instruction-bound at half
 * the memory bandwidth: benchmarks/gemv_bandwidth.py.) The products x * (128 + q)
 * accumulate in float32 (vdpbf16ps: lane i of a 32-bit broadcast pair of x against output
 * i's pair of codes), and per group
 *   sum_k x W = scale * (sum_k x (128 + q) - 136 sum_k x) + zero * sum_k x,
 * with sum_k x of the same bfloat16 inputs. Built and called like paged_decode.c (see
 * native/__init__.py). Without AVX-512 BF16 both are the portable path at the end of this
 * file (portable.h: AVX2, SSE or NEON by the kernel tier's flags), with the same products.
 */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}


/* 1 where the GEMM is built with AVX-512 BF16, 2 where it is the portable path (any other
 * tier) */
int int4_panels_has_gemm(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 2;
#endif
}

AMX_CONTROLS(int4_panels) /* the tiles from amx_rows rows: int4_panels_gemm_amx */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* How far ahead of the octet being multiplied its block's codes are prefetched: a decode
 * GEMV streams many small matrices (a 135M model's layers are 0.2-1 MB each), and the
 * hardware prefetchers ramp up too slowly for each; 2 KB (32 octets) ahead took a 30-layer
 * pass of SmolLM2-shaped int4 layers from 11.9 to 7.5-8.8 ms on one thread (int4 panels
 * read from L3, not L2: the 30-layer pass of benchmarks/gemv_bandwidth.py). */
#define PREFETCH_BYTES 2048

static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The bfloat16 pairs (128 + q at input 8 o + 2 u, 128 + q at 8 o + 2 u + 1) of an octet's
 * lanes: (v >> 4 u) & 0x000F000F | 0x43004300 (ternary logic 0xEA: (a & b) | c). */
#define PAIR_CODES(v, u)                                                                   \
    ((__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32((v), 4 * (u)),                  \
                                         _mm512_set1_epi32(0x000F000F),                    \
                                         _mm512_set1_epi32(0x43004300), 0xEA))

/* Rows [m0, m0 + MT) of y against output block b: MT float32 accumulators stay in
 * registers over a group (each octet's codes expanded once for all MT rows); the
 * running outputs live in `out` (L1), touched once per group. */
static inline __attribute__((always_inline)) void block_rows(
    const int32_t *xp, int64_t k, int64_t m0, const int MT, const uint32_t *pb, const uint16_t *szb,
    int64_t group, const float *xs, int64_t groups, uint16_t *y, int64_t y_stride, int64_t col,
    __mmask16 store_mask, const int one_chain) {
    const __m512 c136 = _mm512_set1_ps(136.0f);
    __m512 out[16];
    for (int r = 0; r < MT; r++) out[r] = _mm512_setzero_ps();
    const int64_t go = group / 8; /* octets per group */
    /* independent chains of multiply-adds per row: with few rows one chain a row would
     * wait on the multiply-add's latency (3 rows: 1.9x the time of one row's 4 chains
     * for 3x the products; 4 sets of accumulators below 4 rows, 2 below 8). one_chain:
     * one set whatever MT, so a row's sums are the same in a tile of any size */
    const int SETS = one_chain || MT >= 8 ? 1 : MT >= 4 ? 2 : 4;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[16];
        for (int r = 0; r < SETS * MT; r++) acc[r] = _mm512_setzero_ps();
        const uint32_t *pg = pb + g * go * 16;
        const int32_t *xg = xp + m0 * (k / 2) + g * go * 4 * MT; /* [pair][row] of this tile */
        for (int64_t o = 0; o < go; o++) {
            _mm_prefetch((const char *)(pg + 16 * o) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void *)(pg + 16 * o));
            for (int u = 0; u < 4; u++) {
                const __m512bh w = PAIR_CODES(v, u);
                const int32_t *xu = xg + (4 * o + u) * MT;
                __m512 *a = acc + (u % SETS) * MT;
                for (int r = 0; r < MT; r++)
                    a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(xu[r]), w);
            }
        }
        for (int set = 1; set < SETS; set++)
            for (int r = 0; r < MT; r++) acc[r] = _mm512_add_ps(acc[r], acc[set * MT + r]);
        const __m512 s = bf16x16(szb + g * 32), z = bf16x16(szb + g * 32 + 16);
        for (int r = 0; r < MT; r++) {
            const __m512 sx = _mm512_set1_ps(xs[(m0 + r) * groups + g]);
            out[r] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(c136, sx, acc[r]), _mm512_fmadd_ps(z, sx, out[r]));
        }
    }
    for (int r = 0; r < MT; r++)
        _mm256_mask_storeu_epi16(y + (m0 + r) * y_stride + col, store_mask,
                                 (__m256i)_mm512_cvtneps_pbh(out[r]));
}

/* One row: the four pairs of an octet go to four independent accumulators (one chain of
 * vdpbf16ps would wait on its latency every pair and leave the loads idle), summed at the
 * group's end. */
static inline void block_row1(const int32_t *x, const uint32_t *pb, const uint16_t *szb,
                              int64_t group, const float *xs, int64_t groups, uint16_t *y,
                              __mmask16 store_mask) {
    const __m512 c136 = _mm512_set1_ps(136.0f);
    const int64_t go = group / 8;
    __m512 out = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const uint32_t *pg = pb + g * go * 16;
        const int32_t *xg = x + g * go * 4;
        for (int64_t o = 0; o < go; o++) {
            _mm_prefetch((const char *)(pg + 16 * o) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void *)(pg + 16 * o));
            const int32_t *xo = xg + 4 * o;
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(xo[0]), PAIR_CODES(v, 0));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(xo[1]), PAIR_CODES(v, 1));
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_set1_epi32(xo[2]), PAIR_CODES(v, 2));
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_set1_epi32(xo[3]), PAIR_CODES(v, 3));
        }
        const __m512 acc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        const __m512 s = bf16x16(szb + g * 32), z = bf16x16(szb + g * 32 + 16);
        const __m512 sx = _mm512_set1_ps(xs[g]);
        out = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(c136, sx, acc), _mm512_fmadd_ps(z, sx, out));
    }
    _mm256_mask_storeu_epi16(y, store_mask, (__m256i)_mm512_cvtneps_pbh(out));
}

/* Dequantize output blocks [first_block, first_block + num_blocks) to bfloat16 W^T:
 * out[k][16 * (b - first_block) + j] = W[16 b + j, k], out row stride 16 * num_blocks. */
int int4_panels_dequant_bf16(const uint32_t *panels, const uint16_t *sz, int64_t k, int64_t group,
                             int64_t first_block, int64_t num_blocks, int num_threads,
                             uint16_t *out) {
    if (k % group || group % 8) return -1;
    const int64_t octets = k / 8, groups = k / group, width = 16 * num_blocks, go = group / 8;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t bi = 0; bi < num_blocks; bi++) {
        const int64_t b = first_block + bi;
        const uint32_t *pb = panels + b * octets * 16;
        const uint16_t *szb = sz + b * groups * 32;
        const __m512i low = _mm512_set1_epi32(15);
        const __m512 eight = _mm512_set1_ps(8.0f);
        for (int64_t g = 0; g < groups; g++) {
            const __m512 s = bf16x16(szb + g * 32), z = bf16x16(szb + g * 32 + 16);
            const __m512 z8 = _mm512_fnmadd_ps(eight, s, z); /* (q - 8) s + z = q s + z8 */
            for (int64_t o = g * go; o < (g + 1) * go; o++) {
                const __m512i v = _mm512_loadu_si512((const void *)(pb + 16 * o));
                for (int u = 0; u < 4; u++) {
                    const __m512 lo = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(v, 4 * u), low));
                    const __m512 hi = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(v, 16 + 4 * u), low));
                    uint16_t *even = out + (8 * o + 2 * u) * width + 16 * bi;
                    _mm256_storeu_si256((__m256i *)even, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(lo, s, z8)));
                    _mm256_storeu_si256((__m256i *)(even + width), (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(hi, s, z8)));
                }
            }
        }
    }
    return 0;
}

/* The GEMM in AMX tiles (amx_tiles.h), from amx_rows rows: a block's codes expand to the
 * bfloat16 pairs (q - 8, exact) with one vpermw from a 32-entry table per 16 pairs (the
 * pairs PAIR_CODES builds, less 136), scales and zeros to float32; W = (q - 8) scale + zero
 * as above. */
#ifdef RADIXSERVE_AMX
#include <omp.h>
#include <stdlib.h>

static int int4_panels_gemm_amx(const uint16_t *x, int64_t m, int64_t k, const uint32_t *panels,
                                const uint16_t *sz, int64_t n, int64_t group, const float *xs,
                                uint16_t *y, int64_t y_stride, int num_threads) {
    const int64_t groups = k / group, octets = k / 8, blocks = (n + 15) / 16;
    const size_t per_thread = amx_scratch_bytes(k, group);
    __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
    char *scratch = aligned_alloc(64, (size_t)num_threads * per_thread);
    if (!scratch) return -2;
    _Pragma("omp parallel num_threads(num_threads)") {
        uint32_t *wb = (uint32_t *)(scratch + (size_t)omp_get_thread_num() * per_thread);
        float *sb = (float *)(wb + (k / 2) * 16), *zb = sb + groups * 16;
        float c[4][16][16] __attribute__((aligned(64)));
        memset(c, 0, sizeof c);
        amx_configure(m < 16 ? (int)m : 16, (int)amx_chunk(group));
        const __m512i table = _mm512_set_epi16( /* bfloat16 (i & 15) - 8, i = 31 .. 0 */
            0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
            (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0,
            (short)0xc0c0, (short)0xc0e0, (short)0xc100,
            0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
            (short)0xbf80, (short)0xc000, (short)0xc040, (short)0xc080, (short)0xc0a0,
            (short)0xc0c0, (short)0xc0e0, (short)0xc100);
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < blocks; b++) {
            const uint32_t *pb = panels + b * octets * 16;
            const uint16_t *szb = sz + b * groups * 32;
            for (int64_t o = 0; o < octets; o++) { /* vpermw reads each word's low 5 bits */
                const __m512i v = _mm512_loadu_si512((const void *)(pb + 16 * o));
                for (int u = 0; u < 4; u++)
                    _mm512_store_si512((void *)(wb + (4 * o + u) * 16),
                                       _mm512_permutexvar_epi16(_mm512_srli_epi32(v, 4 * u), table));
            }
            for (int64_t g = 0; g < groups; g++) {
                _mm512_store_ps(sb + g * 16, bf16x16(szb + g * 32));
                _mm512_store_ps(zb + g * 16, bf16x16(szb + g * 32 + 16));
            }
            const int64_t left = n - 16 * b;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            const char *next = b + 1 < blocks ? (const char *)(pb + octets * 16) : NULL;
            amx_block(x, m, k, group, wb, sb, zb, xs, y, y_stride, 16 * b, mask, c, next,
                      octets * 64);
        }
        _tile_release();
    }
    free(scratch);
    return 0;
}
#endif

/* Row tiles: as few as hold at most 12 rows each, their sizes differing by at most one (the
 * same for packing x and for the products), so each tile reads and expands the panels once:
 * 3 rows are one tile of 3, not a tile of 2 then one of 1 (which read every weight twice:
 * an expert's few rows in an MoE decode step). Tile i starts at tile_start(m, i). */
#define MAX_TILE 12
static inline int64_t tile_count(int64_t m) { return (m + MAX_TILE - 1) / MAX_TILE; }

static inline int64_t tile_start(int64_t m, int64_t i) {
    const int64_t t = tile_count(m), base = m / t, extra = m % t;
    return i * base + (i < extra ? i : extra);
}

/* Deterministic mode (executor/batch_invariant.py): the row counts m, lo <= m <= hi (hi 0:
 * no bound), of int4_panels_gemm_bf16_invariant calls in which every row is computed by the
 * same operations in the same order whatever the other rows. Here every count: that entry
 * runs every tile, one row included, with one accumulator set (the chain block_rows runs
 * from 8 rows) and never the AMX tiles. Returns 0, or -1 where no count qualifies. */
int int4_panels_invariant_rows(int64_t *lo, int64_t *hi) {
    *lo = 1;
    *hi = 0;
    return 0;
}

/* y[m, :n] = x[m, :] W^T for x [m, k] bfloat16 (contiguous), y rows y_stride apart. xs is
 * scratch for m * (k / group) floats, xp for m * k 32-bit words (here x repacked per row
 * tile as [pair][row] in the first half, so a pair's broadcasts for the tile's rows read one
 * cache line instead of rows k apart, which alias in L1 at k = 2048; the portable path
 * widens x to float32 into all of it). Returns 0, or -1 on bad shapes. */
static int gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint32_t *panels,
                     const uint16_t *sz, int64_t n, int64_t group, float *xs, int32_t *xp,
                     uint16_t *y, int64_t y_stride, int num_threads, const int invariant) {
    if (k % group || group % 8 || m < 1) return -1;
    const int64_t groups = k / group, pairs = k / 2, octets = k / 8, blocks = (n + 15) / 16;
#ifdef RADIXSERVE_AMX
    const int amx = !invariant && amx_rows > 0 && m >= amx_rows && group % 16 == 0;
#else
    const int amx = 0;
#endif
    /* per row: its group sums and its place in its tile's [pair][row] copy */
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (m * k >= 65536)")
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *row = x + r * k;
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = 0; i < group; i++) s += bf16_to_f32(row[g * group + i]);
            xs[r * groups + g] = s;
        }
        if (amx) continue; /* the tiles read x as it lies */
        int64_t i = r * tile_count(m) / m; /* the tile holding row r: i or the next */
        while (tile_start(m, i + 1) <= r) i++;
        while (tile_start(m, i) > r) i--;
        const int64_t t0 = tile_start(m, i), mt = tile_start(m, i + 1) - t0;
        int32_t *t = xp + t0 * pairs + (r - t0);
        for (int64_t p = 0; p < pairs; p++) memcpy(t + p * mt, row + 2 * p, sizeof(int32_t));
    }
#ifdef RADIXSERVE_AMX
    if (amx)
        return int4_panels_gemm_amx(x, m, k, panels, sz, n, group, xs, y, y_stride, num_threads);
#endif
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *pb = panels + b * octets * 16;
        const uint16_t *szb = sz + b * groups * 32;
        const int64_t left = n - 16 * b;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        if (m == 1 && !invariant) {
            block_row1(xp, pb, szb, group, xs, groups, y + 16 * b, mask);
            continue;
        }
        for (int64_t i = 0; i < tile_count(m); i++) {
            const int64_t m0 = tile_start(m, i);
#define TILE(MT) \
    case MT: \
        if (invariant) \
            block_rows(xp, k, m0, MT, pb, szb, group, xs, groups, y, y_stride, 16 * b, mask, 1); \
        else \
            block_rows(xp, k, m0, MT, pb, szb, group, xs, groups, y, y_stride, 16 * b, mask, 0); \
        break;
            switch (tile_start(m, i + 1) - m0) { /* constant tile sizes: accumulators in registers */
            TILE(12) TILE(11) TILE(10) TILE(9) TILE(8) TILE(7) TILE(6) TILE(5) TILE(4) TILE(3)
            TILE(2) TILE(1)
            }
#undef TILE
        }
    }
    return 0;
}

int int4_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint32_t *panels,
                          const uint16_t *sz, int64_t n, int64_t group, float *xs, int32_t *xp,
                          uint16_t *y, int64_t y_stride, int num_threads) {
    return gemm_bf16(x, m, k, panels, sz, n, group, xs, xp, y, y_stride, num_threads, 0);
}

/* int4_panels_gemm_bf16 with each row computed as it would be alone (deterministic mode;
 * int4_panels_invariant_rows): one accumulator chain a row in every tile, no AMX. */
int int4_panels_gemm_bf16_invariant(const uint16_t *x, int64_t m, int64_t k,
                                    const uint32_t *panels, const uint16_t *sz, int64_t n,
                                    int64_t group, float *xs, int32_t *xp, uint16_t *y,
                                    int64_t y_stride, int num_threads) {
    return gemm_bf16(x, m, k, panels, sz, n, group, xs, xp, y, y_stride, num_threads, 1);
}
#else /* the portable path (portable.h): AVX2, SSE or NEON, by the tier's flags */
/* the products and sums exactly as written: with -fassociative-math GCC regrouped them into
 * separate multiplies and adds and kept the accumulators on the stack (125 instructions an
 * octet instead of about 60); portable.h inside, so that its helpers inline */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
#include "portable.h"

/* Rows [0, MT) of x (float32, rows k apart) against one output block: per octet, each pair of codes
 * becomes the float32 values 128 + q exactly (the bfloat16 trick of the AVX-512 path:
 * (v >> 4 u) & 0x000F000F | 0x43004300, then each 16-bit half moved into a float32's high
 * half), multiplied by the pair of x at those inputs; per group, as there,
 *   sum_k x W = scale * (sum_k x (128 + q) - 136 sum_k x) + zero * sum_k x.
 * Accumulators: two per row (the block's two halves of eight outputs), all in registers
 * (16 of eight lanes on AVX2: a fourth index, or more rows, spilled them to the stack);
 * one row gets two chains per half (even and odd inputs), four multiply-adds in flight. */
static inline __attribute__((always_inline)) void block_rows_portable(
    const float *x, int64_t k, const int MT, const uint32_t *pb, const uint16_t *szb,
    int64_t group, const float *xs, int64_t groups, uint16_t *y, int64_t y_stride,
    int64_t count) {
    enum { MAXR = 4 };
    const int CH = MT == 1 ? 2 : 1; /* four chains a half spilled; two measured faster */
    const u32x8 low = splat_u32x8(0x000F000Fu), bias = splat_u32x8(0x43004300u),
                high = splat_u32x8(0xFFFF0000u);
    const int64_t go = group / 8;
    f32x8 out[MAXR][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) out[r][0] = out[r][1] = splat_f32x8(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        f32x8 acc[MAXR][2][2]; /* [row][half][chain] */
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++)
            _Pragma("GCC unroll 4") for (int c = 0; c < CH; c++)
                acc[r][0][c] = acc[r][1][c] = splat_f32x8(0.0f);
        for (int64_t o = g * go; o < (g + 1) * go; o++) {
            __builtin_prefetch((const char *)(pb + 16 * o) + 2048);
            const u32x8 v0 = load_u32x8(pb + 16 * o), v1 = load_u32x8(pb + 16 * o + 8);
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
                const u32x8 t0 = ((v0 >> (4 * u)) & low) | bias, t1 = ((v1 >> (4 * u)) & low) | bias;
                const f32x8 e0 = (f32x8)(t0 << 16), o0 = (f32x8)(t0 & high);
                const f32x8 e1 = (f32x8)(t1 << 16), o1 = (f32x8)(t1 & high);
                const int ce = 0, co = CH - 1; /* even and odd inputs' chains */
                _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {
                    const f32x8 xe = splat_f32x8(x[r * k + 8 * o + 2 * u]);
                    const f32x8 xo = splat_f32x8(x[r * k + 8 * o + 2 * u + 1]);
                    acc[r][0][ce] += xe * e0;
                    acc[r][1][ce] += xe * e1;
                    acc[r][0][co] += xo * o0;
                    acc[r][1][co] += xo * o1;
                }
            }
        }
        const f32x8 s0 = bf16x8(szb + g * 32), s1 = bf16x8(szb + g * 32 + 8);
        const f32x8 z0 = bf16x8(szb + g * 32 + 16), z1 = bf16x8(szb + g * 32 + 24);
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {
            const float sx = xs[r * groups + g];
            f32x8 a0 = acc[r][0][0], a1 = acc[r][1][0];
            _Pragma("GCC unroll 4") for (int c = 1; c < CH; c++) {
                a0 += acc[r][0][c];
                a1 += acc[r][1][c];
            }
            out[r][0] += s0 * (a0 - 136.0f * sx) + z0 * sx;
            out[r][1] += s1 * (a1 - 136.0f * sx) + z1 * sx;
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++)
        store_bf16x16(y + r * y_stride, out[r][0], out[r][1], count);
}

/* Deterministic mode (see the AVX-512 path's): here every tile of two rows or more sums a
 * row's products in one chain (CH = 1), and from m = 2 every tile holds 2 to 4 rows. */
int int4_panels_invariant_rows(int64_t *lo, int64_t *hi) {
    *lo = 2;
    *hi = 0;
    return 0;
}

int int4_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint32_t *panels,
                          const uint16_t *sz, int64_t n, int64_t group, float *xs, int32_t *xp,
                          uint16_t *y, int64_t y_stride, int num_threads) {
    if (k % group || group % 8 || m < 1) return -1;
    const int64_t groups = k / group, octets = k / 8, blocks = (n + 15) / 16;
    float *xf = (float *)xp; /* x widened to float32 (broadcasts from memory), in xp */
    widen_rows(x, m, k, group, xf, xs);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *pb = panels + b * octets * 16;
        const uint16_t *szb = sz + b * groups * 32;
        const int64_t count = n - 16 * b;
        for (int64_t i = 0; i < ptile_count(m); i++) {
            const int64_t m0 = ptile_start(m, i);
            const float *xt = xf + m0 * k, *xst = xs + m0 * groups;
            uint16_t *yt = y + m0 * y_stride + 16 * b;
#define TILE(MT) \
    case MT: block_rows_portable(xt, k, MT, pb, szb, group, xst, groups, yt, y_stride, count); break;
            switch (ptile_start(m, i + 1) - m0) {
            TILE(4) TILE(3) TILE(2) default: TILE(1)
            }
#undef TILE
        }
    }
    return 0;
}

/* The portable path's calls of 2 rows or more already compute each row alone. */
int int4_panels_gemm_bf16_invariant(const uint16_t *x, int64_t m, int64_t k,
                                    const uint32_t *panels, const uint16_t *sz, int64_t n,
                                    int64_t group, float *xs, int32_t *xp, uint16_t *y,
                                    int64_t y_stride, int num_threads) {
    return int4_panels_gemm_bf16(x, m, k, panels, sz, n, group, xs, xp, y, y_stride, num_threads);
}

int int4_panels_dequant_bf16(const uint32_t *panels, const uint16_t *sz, int64_t k, int64_t group,
                             int64_t first_block, int64_t num_blocks, int num_threads,
                             uint16_t *out) {
    if (k % group || group % 8) return -1;
    const int64_t octets = k / 8, groups = k / group, width = 16 * num_blocks, go = group / 8;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t bi = 0; bi < num_blocks; bi++) {
        const int64_t b = first_block + bi;
        const uint32_t *pb = panels + b * octets * 16;
        const uint16_t *szb = sz + b * groups * 32;
        for (int64_t g = 0; g < groups; g++) {
            for (int h = 0; h < 2; h++) {
                const f32x8 s = bf16x8(szb + g * 32 + 8 * h), z = bf16x8(szb + g * 32 + 16 + 8 * h);
                const f32x8 z8 = z - 8.0f * s; /* (q - 8) s + z = q s + z8 */
                for (int64_t o = g * go; o < (g + 1) * go; o++) {
                    const u32x8 v = load_u32x8(pb + 16 * o + 8 * h);
                    for (int u = 0; u < 4; u++) {
                        const f32x8 lo = __builtin_convertvector((i32x8)((v >> (4 * u)) & 15u), f32x8);
                        const f32x8 hi = __builtin_convertvector((i32x8)((v >> (16 + 4 * u)) & 15u), f32x8);
                        const u16x8 e = to_bf16x8(lo * s + z8), d = to_bf16x8(hi * s + z8);
                        uint16_t *even = out + (8 * o + 2 * u) * width + 16 * bi + 8 * h;
                        memcpy(even, &e, sizeof e);
                        memcpy(even + width, &d, sizeof d);
                    }
                }
            }
        }
    }
    return 0;
}
#pragma GCC pop_options
#endif
