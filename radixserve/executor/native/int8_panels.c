/* Group-wise int8 weights in "panels": W[n, k] = q[n, k] * scale[n, k / G] (+ zero[n, k / G]),
 * multiplied without leaving the kernel: a GEMM for a few rows (decode) and a dequantizer
 * to bfloat16 for many (prefill, then oneDNN's GEMM). It holds GGUF's Q8_0, Q6_K, Q5_0,
 * Q5_1 and Q5_K tensors exactly (their codes as they are, one scale per block of 32 or 16
 * inputs) up to the float16 rounding of the scales.
 *
 * Layout (executor/quant.py: ``to_int8_panels``), N padded to a multiple of 16:
 *   panels [N/16][K][16] int8: byte j of (block b, input k) is q[16 b + j, k];
 *   scale  [N/16][K/G][16] float16; zero the same, or NULL (all zero).
 * A decode row streams each block's K * 16 bytes once, front to back: int8 plus a float16
 * scale per G inputs is 8.5 bits a weight at G = 32 (9 with zeros), 9 at G = 16.
 *
 * Products: codes widened to float32 (exact), x (bfloat16) widened to float32 (exact),
 * fused multiply-adds in float32 per group, then out += scale * acc + zero * sum(x over
 * the group). Several rows go in tiles of up to 16, each input's codes widened once per
 * tile. Where the caller turns it on (dp_rows, below: AMD CPUs), tiles multiply bfloat16
 * pairs of codes with vdpbf16ps instead, two products a lane per instruction. (On a Xeon
 * with AVX-512 BF16 one vdpbf16ps costs two multiply-adds' issue slots, so there the pairs
 * gain nothing and building them costs more than widening the codes.) Without AVX-512
 * (F, BW, BF16) both entry points are the portable path at the end of this file
 * (portable.h: AVX2, SSE or NEON by the kernel tier's flags), with the same products.
 */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"

AMX_CONTROLS(int8_panels) /* the tiles from amx_rows rows: int8_panels_gemm_amx */

/* 1 where the GEMM is built with AVX-512 BF16, 2 where it is the portable path (any other
 * tier) */
int int8_panels_has_gemm(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    return 1;
#else
    return 2;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* Codes prefetched this far ahead of the 16 being multiplied (as in int4_panels.c: the
 * hardware prefetchers ramp up too slowly for a decode step's many small matrices). */
#define PREFETCH_BYTES 2048

static inline __m512 f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 codes16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* Row tiles for m >= 2 rows: as few as hold at most MAX_TILE rows each, their sizes
 * within one of each other (m = 16: one of 16; 17: 9 and 8; 31: 16 and 15), so that each
 * input's codes are widened as few times as possible (12, 12, 4, 2, 1 before: 5 tiles for
 * 31 rows). Tile i starts at tile_start(m, i). */
#define MAX_TILE 16

static inline int64_t tile_count(int64_t m) { return (m + MAX_TILE - 1) / MAX_TILE; }

static inline int64_t tile_start(int64_t m, int64_t i) {
    const int64_t t = tile_count(m), base = m / t, extra = m % t;
    return i * base + (i < extra ? i : extra);
}

/* A group's end in a row tile: acc (+ acc2, a second accumulator set, or NULL) folded into
 * out with the group's scales (and zeros, times the rows' sums of x over the group). */
static inline __attribute__((always_inline)) void fold_group(
    __m512 *out, __m512 *acc, const __m512 *acc2, const int MT, const uint16_t *sb,
    const uint16_t *zb, const float *xs, int64_t m0, int64_t groups, int64_t g) {
    if (acc2)
        for (int r = 0; r < MT; r++) acc[r] = _mm512_add_ps(acc[r], acc2[r]);
    const __m512 s = f16x16(sb + g * 16);
    for (int r = 0; r < MT; r++) out[r] = _mm512_fmadd_ps(s, acc[r], out[r]);
    if (zb) {
        const __m512 z = f16x16(zb + g * 16);
        for (int r = 0; r < MT; r++)
            out[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[(m0 + r) * groups + g]), out[r]);
    }
}

/* A row tile's outputs rounded to bfloat16: row r at y + r * y_stride, store_mask's columns */
static inline __attribute__((always_inline)) void store_rows(const __m512 *out, const int MT,
                                                             uint16_t *y, int64_t y_stride,
                                                             __mmask16 store_mask) {
    for (int r = 0; r < MT; r++)
        _mm256_mask_storeu_epi16(y + r * y_stride, store_mask, (__m256i)_mm512_cvtneps_pbh(out[r]));
}

/* Rows [m0, m0 + MT) against output block b. xt: this tile's x as float32 [k][MT]; xs: per
 * row and group the sum of x (only read with zeros). Each input's 16 codes are widened once
 * for the tile's MT rows; below 8 rows (fewer chains than a multiply-add's latency times
 * its throughput), two accumulator sets (even and odd inputs), summed at the group's end. */
static inline __attribute__((always_inline)) void block_rows(
    const float *xt, int64_t m0, const int MT, const int8_t *pb, const uint16_t *sb,
    const uint16_t *zb, int64_t group, const float *xs, int64_t groups, uint16_t *y,
    int64_t y_stride, int64_t col, __mmask16 store_mask) {
    const int two = MT < 8; /* a second accumulator set */
    __m512 out[MAX_TILE];
    for (int r = 0; r < MT; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[MAX_TILE], acc2[MAX_TILE];
        for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
        if (two)
            for (int r = 0; r < MT; r++) acc2[r] = _mm512_setzero_ps();
        const int8_t *pg = pb + g * group * 16;
        const float *xg = xt + g * group * MT;
        for (int64_t i = 0; i < group; i += 2) {
            if (i % 4 == 0) _mm_prefetch((const char *)(pg + 16 * i) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512 w0 = codes16(pg + 16 * i), w1 = codes16(pg + 16 * (i + 1));
            const float *x0 = xg + i * MT, *x1 = x0 + MT;
            for (int r = 0; r < MT; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x0[r]), w0, acc[r]);
            if (two)
                for (int r = 0; r < MT; r++)
                    acc2[r] = _mm512_fmadd_ps(_mm512_set1_ps(x1[r]), w1, acc2[r]);
            else
                for (int r = 0; r < MT; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x1[r]), w1, acc[r]);
        }
        fold_group(out, acc, two ? acc2 : NULL, MT, sb, zb, xs, m0, groups, g);
    }
    store_rows(out, MT, y + m0 * y_stride + col, y_stride, store_mask);
}

/* One row: four independent accumulators per group (a multiply-add's latency is four
 * cycles; one chain would leave the loads waiting), summed at the group's end. */
static inline void block_row1(const float *x, const int8_t *pb, const uint16_t *sb,
                              const uint16_t *zb, int64_t group, const float *xs, int64_t groups,
                              uint16_t *y, __mmask16 store_mask) {
    __m512 out = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const int8_t *pg = pb + g * group * 16;
        const float *xg = x + g * group;
        for (int64_t i = 0; i < group; i += 4) {
            _mm_prefetch((const char *)(pg + 16 * i) + PREFETCH_BYTES, _MM_HINT_T0);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(xg[i]), codes16(pg + 16 * i), a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(xg[i + 1]), codes16(pg + 16 * (i + 1)), a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(xg[i + 2]), codes16(pg + 16 * (i + 2)), a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(xg[i + 3]), codes16(pg + 16 * (i + 3)), a3);
        }
        const __m512 acc = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
        out = _mm512_fmadd_ps(f16x16(sb + g * 16), acc, out);
        if (zb) out = _mm512_fmadd_ps(f16x16(zb + g * 16), _mm512_set1_ps(xs[g]), out);
    }
    _mm256_mask_storeu_epi16(y, store_mask, (__m256i)_mm512_cvtneps_pbh(out));
}

/* Rows from dp_rows (int8_panels_set_dp_rows; 0: never) multiply bfloat16 pairs instead:
 * vdpbf16ps takes x's pair (inputs i, i + 1 of a row, as it lies in memory, one 32-bit
 * broadcast) against the pair of codes in each output's 32-bit lane, two products a lane
 * per instruction. The codes become bfloat16 exactly (a float32 of an integer below 2^8 in
 * magnitude has only zeros in its low 16 bits): widened to float32 as above, then input
 * i + 1's high halves and input i's high halves shifted down, in one ternary-logic op.
 * Where vdpbf16ps costs one multiply-add's issue slot (AMD Zen 4 and 5) that halves the
 * multiply-adds of a tile; where it costs two (Xeon) it gains nothing (dp_rows stays 0). */
static int dp_rows = 0;

void int8_panels_set_dp_rows(int rows) { dp_rows = rows; }
int int8_panels_dp_rows(void) { return dp_rows; }

/* Deterministic mode (executor/batch_invariant.py): the row counts m, lo <= m <= hi (hi 0:
 * no bound), of calls in which every row is computed by the same operations in the same
 * order whatever the other rows. Here: no block_row1 (m = 1) and tiles of 8 rows or more, one
 * accumulator set each (from m = 8 every tile holds 8 to 16), every call on the same side of
 * dp_rows, and below the AMX tiles. Returns 0, or -1 where no count qualifies. */
int int8_panels_invariant_rows(int64_t *lo, int64_t *hi) {
    *lo = dp_rows > 8 ? dp_rows : 8;
    *hi = amx_rows > 0 ? amx_rows - 1 : 0;
    return *hi && *hi < *lo ? -1 : 0;
}

static inline __m512bh pair_codes(const int8_t *p) {
    const __m512i even = _mm512_castps_si512(codes16(p));
    const __m512i odd = _mm512_castps_si512(codes16(p + 16));
    /* (odd & 0xFFFF0000) | (even >> 16): ternary logic 0xEA, (a & b) | c */
    return (__m512bh)_mm512_ternarylogic_epi32(odd, _mm512_set1_epi32((int)0xFFFF0000u),
                                               _mm512_srli_epi32(even, 16), 0xEA);
}

/* block_rows with bfloat16 pairs: xp this tile's x pairs [k / 2][MT] (32-bit words, two
 * bfloat16 inputs each; gemm_bf16 transposes them per tile), each broadcast against the
 * codes' pairs of the same two inputs. */
static inline __attribute__((always_inline)) void block_rows_dp(
    const uint32_t *xp, int64_t m0, const int MT, const int8_t *pb,
    const uint16_t *sb, const uint16_t *zb, int64_t group, const float *xs, int64_t groups,
    uint16_t *y, int64_t y_stride, int64_t col, __mmask16 store_mask) {
    const int two = MT < 8; /* a second accumulator set */
    __m512 out[MAX_TILE];
    for (int r = 0; r < MT; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[MAX_TILE], acc2[MAX_TILE];
        for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
        if (two)
            for (int r = 0; r < MT; r++) acc2[r] = _mm512_setzero_ps();
        const int8_t *pg = pb + g * group * 16;
        const uint32_t *xg = xp + g * (group / 2) * MT;
        for (int64_t i = 0; i < group; i += 4) {
            _mm_prefetch((const char *)(pg + 16 * i) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m512bh w0 = pair_codes(pg + 16 * i), w1 = pair_codes(pg + 16 * (i + 2));
            const uint32_t *x0 = xg + (i / 2) * MT, *x1 = x0 + MT;
            for (int r = 0; r < MT; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], w0, (__m512bh)_mm512_set1_epi32((int)x0[r]));
            if (two)
                for (int r = 0; r < MT; r++)
                    acc2[r] = _mm512_dpbf16_ps(acc2[r], w1, (__m512bh)_mm512_set1_epi32((int)x1[r]));
            else
                for (int r = 0; r < MT; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], w1, (__m512bh)_mm512_set1_epi32((int)x1[r]));
        }
        fold_group(out, acc, two ? acc2 : NULL, MT, sb, zb, xs, m0, groups, g);
    }
    store_rows(out, MT, y + m0 * y_stride + col, y_stride, store_mask);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The GEMM in AMX tiles (amx_tiles.h), from amx_rows rows: a block's codes expand to
 * bfloat16 pairs (the codes, exact: a float32 of an integer below 2^8 in magnitude has only
 * zeros in its low 16 bits), scales and zeros to float32. */
#ifdef RADIXSERVE_AMX
#include <omp.h>
#include <stdlib.h>

static int int8_panels_gemm_amx(const uint16_t *x, int64_t m, int64_t k, const int8_t *panels,
                                const uint16_t *scale, const uint16_t *zero, int64_t n,
                                int64_t group, const float *xs, uint16_t *y, int64_t y_stride,
                                int num_threads) {
    const int64_t groups = k / group, blocks = (n + 15) / 16;
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
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *pb = panels + b * k * 16;
            for (int64_t p = 0; p < k / 2; p++) {
                if (p % 2 == 0) _mm_prefetch((const char *)(pb + 32 * p) + PREFETCH_BYTES, _MM_HINT_T0);
                const __m512i even = _mm512_castps_si512(codes16(pb + 32 * p));
                const __m512i odd = _mm512_castps_si512(codes16(pb + 32 * p + 16));
                /* (odd & 0xFFFF0000) | (even >> 16): ternary logic 0xEA, (a & b) | c */
                _mm512_store_si512((void *)(wb + 16 * p),
                                   _mm512_ternarylogic_epi32(odd, high, _mm512_srli_epi32(even, 16), 0xEA));
            }
            const uint16_t *sbb = scale + b * groups * 16;
            const uint16_t *zbb = zero ? zero + b * groups * 16 : NULL;
            for (int64_t g = 0; g < groups; g++) {
                _mm512_store_ps(sb + g * 16, f16x16(sbb + g * 16));
                if (zbb) _mm512_store_ps(zb + g * 16, f16x16(zbb + g * 16));
            }
            const int64_t left = n - 16 * b;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            const char *next = b + 1 < blocks ? (const char *)(pb + k * 16) : NULL;
            amx_block(x, m, k, group, wb, sb, zbb ? zb : NULL, xs, y, y_stride, 16 * b, mask, c,
                      next, k * 16);
        }
        _tile_release();
    }
    free(scratch);
    return 0;
}
#endif

/* y[m, :n] = x[m, :] W^T for x [m, k] bfloat16 (contiguous), y rows y_stride apart (bfloat16,
 * rounded to nearest even). xt is scratch for m * k floats: x as float32, per row tile
 * [k][tile rows] (m = 1: just the row); xs for m * (k / group). Returns 0, or -1 on bad
 * shapes. */
int int8_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const int8_t *panels,
                          const uint16_t *scale, const uint16_t *zero, int64_t n, int64_t group,
                          float *xt, float *xs, uint16_t *y, int64_t y_stride, int num_threads) {
    if (group % 4 || k % group || m < 1) return -1;
    const int64_t groups = k / group, blocks = (n + 15) / 16;
    if (zero) /* group sums of x */
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t i = 0; i < group; i++) s += bf16_to_f32(x[r * k + g * group + i]);
                xs[r * groups + g] = s;
            }
#ifdef RADIXSERVE_AMX
    if (amx_rows > 0 && m >= amx_rows && group % 16 == 0)
        return int8_panels_gemm_amx(x, m, k, panels, scale, zero, n, group, xs, y, y_stride,
                                    num_threads);
#endif
    const int pairs = dp_rows > 0 && m >= dp_rows && m > 1 && group % 4 == 0;
    if (m == 1) {
        for (int64_t i = 0; i < k; i++) xt[i] = bf16_to_f32(x[i]);
    } else if (pairs) { /* per row tile, x's pairs [k / 2][tile rows] as 32-bit words */
        uint32_t *xp = (uint32_t *)xt;
        for (int64_t i = 0; i < tile_count(m); i++) {
            const int64_t t0 = tile_start(m, i), mt = tile_start(m, i + 1) - t0;
            for (int64_t r = 0; r < mt; r++) {
                const uint16_t *row = x + (t0 + r) * k; /* 2-byte aligned: memcpy pairs */
                uint32_t *t = xp + t0 * (k / 2) + r;
                for (int64_t j = 0; j < k / 2; j++) memcpy(t + j * mt, row + 2 * j, 4);
            }
        }
    } else {
        for (int64_t i = 0; i < tile_count(m); i++) {
            const int64_t t0 = tile_start(m, i), mt = tile_start(m, i + 1) - t0;
            for (int64_t r = 0; r < mt; r++) {
                const uint16_t *row = x + (t0 + r) * k;
                float *t = xt + t0 * k + r;
                for (int64_t j = 0; j < k; j++) t[j * mt] = bf16_to_f32(row[j]);
            }
        }
    }
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *pb = panels + b * k * 16;
        const uint16_t *sb = scale + b * groups * 16;
        const uint16_t *zb = zero ? zero + b * groups * 16 : NULL;
        const int64_t left = n - 16 * b;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        if (m == 1) {
            block_row1(xt, pb, sb, zb, group, xs, groups, y + 16 * b, mask);
            continue;
        }
        for (int64_t i = 0; i < tile_count(m); i++) {
            const int64_t m0 = tile_start(m, i);
            const float *t = xt + m0 * k;
            if (pairs) {
#define ROWS(MT) \
    case MT: block_rows_dp((const uint32_t *)xt + m0 * (k / 2), m0, MT, pb, sb, zb, group, xs, groups, y, y_stride, 16 * b, mask); break
                switch (tile_start(m, i + 1) - m0) {
                ROWS(16); ROWS(15); ROWS(14); ROWS(13); ROWS(12); ROWS(11); ROWS(10); ROWS(9);
                ROWS(8); ROWS(7); ROWS(6); ROWS(5); ROWS(4); ROWS(3); ROWS(2);
                default: break;
                }
#undef ROWS
                continue;
            }
#define ROWS(MT) \
    case MT: block_rows(t, m0, MT, pb, sb, zb, group, xs, groups, y, y_stride, 16 * b, mask); break
            switch (tile_start(m, i + 1) - m0) { /* constant tile sizes: accumulators in registers */
            ROWS(16); ROWS(15); ROWS(14); ROWS(13); ROWS(12); ROWS(11); ROWS(10); ROWS(9);
            ROWS(8); ROWS(7); ROWS(6); ROWS(5); ROWS(4); ROWS(3); ROWS(2);
            default: break; /* unreachable: the tiles of m >= 2 rows hold 2 to 16 */
            }
#undef ROWS
        }
    }
    return 0;
}

/* Dequantize output blocks [first_block, first_block + num_blocks) to bfloat16 W^T:
 * out[k][16 * (b - first_block) + j] = W[16 b + j, k], out row stride 16 * num_blocks. */
int int8_panels_dequant_bf16(const int8_t *panels, const uint16_t *scale, const uint16_t *zero,
                             int64_t k, int64_t group, int64_t first_block, int64_t num_blocks,
                             int num_threads, uint16_t *out) {
    if (k % group) return -1;
    const int64_t groups = k / group, width = 16 * num_blocks;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t bi = 0; bi < num_blocks; bi++) {
        const int64_t b = first_block + bi;
        const int8_t *pb = panels + b * k * 16;
        const uint16_t *sb = scale + b * groups * 16;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 s = f16x16(sb + g * 16);
            const __m512 z = zero ? f16x16(zero + b * groups * 16 + g * 16) : _mm512_setzero_ps();
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                const __m512 w = _mm512_fmadd_ps(codes16(pb + 16 * i), s, z);
                _mm256_storeu_si256((__m256i *)(out + i * width + 16 * bi),
                                    (__m256i)_mm512_cvtneps_pbh(w));
            }
        }
    }
    return 0;
}
#else /* the portable path (portable.h): AVX2, SSE or NEON, by the tier's flags */
/* the products and sums exactly as written (int4_panels.c's portable path says why) */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
#include "portable.h"

void int8_panels_set_dp_rows(int rows) { (void)rows; } /* pairs need vdpbf16ps */
int int8_panels_dp_rows(void) { return 0; }

/* Deterministic mode (see the AVX-512 path's): here every tile of two rows or more sums a
 * row's products in one chain (CH = 1), and from m = 2 every tile holds 2 to 4 rows. */
int int8_panels_invariant_rows(int64_t *lo, int64_t *hi) {
    *lo = 2;
    *hi = 0;
    return 0;
}

/* Rows [0, MT) of x (float32, rows k apart) against one output block: each input's 16
 * codes widened to float32 once for the tile's rows, multiply-adds in float32 per group,
 * then out += scale * acc + zero * sum(x over the group), as the AVX-512 path. Four inputs
 * (64 bytes of codes) an iteration; accumulators two per row (the block's halves), all in
 * registers; one row gets two chains per half (even and odd inputs). */
static inline __attribute__((always_inline)) void block_rows_portable(
    const float *x, int64_t k, const int MT, const int8_t *pb, const uint16_t *sb,
    const uint16_t *zb, int64_t group, const float *xs, int64_t groups, uint16_t *y,
    int64_t y_stride, int64_t count) {
    enum { MAXR = 4 };
    const int CH = MT == 1 ? 2 : 1;
    f32x8 out[MAXR][2];
    _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) out[r][0] = out[r][1] = splat_f32x8(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        f32x8 acc[MAXR][2][2]; /* [row][half][chain] */
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++)
            _Pragma("GCC unroll 2") for (int c = 0; c < CH; c++)
                acc[r][0][c] = acc[r][1][c] = splat_f32x8(0.0f);
        for (int64_t i = g * group; i < (g + 1) * group; i += 4) {
            __builtin_prefetch((const char *)(pb + 16 * i) + 2048);
            _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {
                const f32x8 w0 = i8x8_f32(pb + 16 * (i + e)), w1 = i8x8_f32(pb + 16 * (i + e) + 8);
                const int c = CH == 2 ? e & 1 : 0;
                _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {
                    const f32x8 xv = splat_f32x8(x[r * k + i + e]);
                    acc[r][0][c] += xv * w0;
                    acc[r][1][c] += xv * w1;
                }
            }
        }
        const f32x8 s0 = f16x8(sb + g * 16), s1 = f16x8(sb + g * 16 + 8);
        _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {
            f32x8 a0 = acc[r][0][0], a1 = acc[r][1][0];
            _Pragma("GCC unroll 2") for (int c = 1; c < CH; c++) {
                a0 += acc[r][0][c];
                a1 += acc[r][1][c];
            }
            out[r][0] += s0 * a0;
            out[r][1] += s1 * a1;
        }
        if (zb) {
            const f32x8 z0 = f16x8(zb + g * 16), z1 = f16x8(zb + g * 16 + 8);
            _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++) {
                out[r][0] += z0 * xs[r * groups + g];
                out[r][1] += z1 * xs[r * groups + g];
            }
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < MT; r++)
        store_bf16x16(y + r * y_stride, out[r][0], out[r][1], count);
}

/* The entry point of the AVX-512 path above; xt holds x as float32 [m][k] here. */
int int8_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const int8_t *panels,
                          const uint16_t *scale, const uint16_t *zero, int64_t n, int64_t group,
                          float *xt, float *xs, uint16_t *y, int64_t y_stride, int num_threads) {
    if (group % 4 || k % group || m < 1) return -1;
    const int64_t groups = k / group, blocks = (n + 15) / 16;
    widen_rows(x, m, k, group, xt, xs);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *pb = panels + b * k * 16;
        const uint16_t *sb = scale + b * groups * 16;
        const uint16_t *zb = zero ? zero + b * groups * 16 : NULL;
        const int64_t count = n - 16 * b;
        for (int64_t i = 0; i < ptile_count(m); i++) {
            const int64_t m0 = ptile_start(m, i);
            const float *xr = xt + m0 * k, *xsr = xs + m0 * groups;
            uint16_t *yt = y + m0 * y_stride + 16 * b;
#define TILE(MT) \
    case MT: block_rows_portable(xr, k, MT, pb, sb, zb, group, xsr, groups, yt, y_stride, count); break;
            switch (ptile_start(m, i + 1) - m0) {
            TILE(4) TILE(3) TILE(2) default: TILE(1)
            }
#undef TILE
        }
    }
    return 0;
}

int int8_panels_dequant_bf16(const int8_t *panels, const uint16_t *scale, const uint16_t *zero,
                             int64_t k, int64_t group, int64_t first_block, int64_t num_blocks,
                             int num_threads, uint16_t *out) {
    if (k % group) return -1;
    const int64_t groups = k / group, width = 16 * num_blocks;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t bi = 0; bi < num_blocks; bi++) {
        const int64_t b = first_block + bi;
        const int8_t *pb = panels + b * k * 16;
        const uint16_t *sb = scale + b * groups * 16;
        for (int64_t g = 0; g < groups; g++)
            for (int h = 0; h < 2; h++) {
                const f32x8 s = f16x8(sb + g * 16 + 8 * h);
                const f32x8 z = zero ? f16x8(zero + b * groups * 16 + g * 16 + 8 * h)
                                     : splat_f32x8(0.0f);
                for (int64_t i = g * group; i < (g + 1) * group; i++) {
                    const u16x8 w = to_bf16x8(i8x8_f32(pb + 16 * i + 8 * h) * s + z);
                    memcpy(out + i * width + 16 * bi + 8 * h, &w, sizeof w);
                }
            }
    }
    return 0;
}
#pragma GCC pop_options
#endif
