/* AMX tiles (Sapphire Rapids and later) for the panel GEMMs (int4_panels.c, int8_panels.c):
 * the multiply-adds of a few to a few hundred rows in the tile unit, with the weights never
 * rounded.
 *
 * Each caller expands one output block's codes per call to exact bfloat16 (small integers:
 * q - 8 for int4, q for int8) in tdpbf16ps's B layout, `wb`: pair row p = the block's 16
 * outputs' codes at inputs 2 p, 2 p + 1 (output j's pair in 32-bit lane j), and the block's
 * scales and zeros per group as float32 (`sb`, `zb`, [groups][16]). amx_block() then takes x
 * (bfloat16 [m][k], rows k apart) as the A operand as it lies, 16 rows a tile, and per group
 * stores the tile sums C = x q and folds them into float32 outputs held in registers,
 *   out += scale * C + zero * sum_k x,
 * four groups' C tiles at a time, so that their products overlap in the tile unit. Rows
 * past a multiple of 16 go in a last tile of 16 that overlaps the one before (it stores the
 * same values again); fewer than 16 rows configure shorter tiles (amx_configure).
 *
 * The tile unit is usable only after the process asked Linux for it (arch_prctl
 * ARCH_REQ_XCOMP_PERM; native/__init__.py: amx_permission): callers run this only when the
 * loader has enabled it. Tile numbers: 0-3 C; 4, 5 A; 6, 7 B.
 */
#ifndef RADIXSERVE_AMX_TILES_H
#define RADIXSERVE_AMX_TILES_H
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXSERVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* This thread's tiles for tiles of `rows` rows (at most 16) and kc inputs (16 or 32) a
 * product. */
static inline void amx_configure(int rows, int kc) {
    amx_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = (uint16_t)(2 * kc);
    for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(kc / 2), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* The inputs a product takes for groups of `group` (a multiple of 16). */
static inline int64_t amx_chunk(int64_t group) { return group % 32 == 0 ? 32 : 16; }

/* One group's sums x q into tile C from A and B tiles A, B (literals: the tile instructions
 * take their tile numbers as immediates), stored to c[C]. */
#define AMX_GROUP(C, A, B, xg, wg)                                                          \
    do {                                                                                    \
        _tile_zero(C);                                                                      \
        for (int64_t i = 0; i < group; i += kc) {                                           \
            _tile_loadd(A, (xg) + i, 2 * k);                                                \
            _tile_loadd(B, (wg) + i * 8, 64);                                               \
            _tile_dpbf16ps(C, A, B);                                                        \
        }                                                                                   \
        _tile_stored(C, c[C], 64);                                                          \
    } while (0)

static inline __attribute__((always_inline)) void amx_fold(__m512 *out, const float (*cg)[16],
                                                           const float *sg, const float *zg,
                                                           const float *xs, int64_t m0,
                                                           int64_t m, int64_t groups, int64_t g) {
    const __m512 s = _mm512_load_ps(sg);
    for (int r = 0; r < 16; r++) out[r] = _mm512_fmadd_ps(s, _mm512_load_ps(cg[r]), out[r]);
    if (zg) {
        const __m512 z = _mm512_load_ps(zg);
        for (int r = 0; r < 16; r++) {
            const int64_t row = m0 + r < m ? m0 + r : m - 1; /* rows past m: never stored */
            out[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[row * groups + g]), out[r]);
        }
    }
}

/* y[:, col .. col + 16) (bfloat16, store_mask's columns) = x W^T for one block: wb, sb, zb
 * (zb NULL: no zeros) as above, xs the group sums of x's rows ([m][groups], read only with
 * zeros), c scratch for four C tiles. `next` (next_bytes long, or NULL) is the caller's
 * next block of codes: fetched into L2 a slice per group while the tiles work, so that
 * expanding it reads from cache (without, a decode step's large LM head alternated a
 * memory-bound expansion with compute-bound tiles). */
static inline void amx_block(const uint16_t *x, int64_t m, int64_t k, int64_t group,
                             const uint32_t *wb, const float *sb, const float *zb,
                             const float *xs, uint16_t *y, int64_t y_stride, int64_t col,
                             __mmask16 store_mask, float (*c)[16][16], const char *next,
                             int64_t next_bytes) {
    const int64_t kc = amx_chunk(group), groups = k / group;
    /* cache lines of `next` to fetch per group of the first row tile */
    const int64_t lines = next ? (next_bytes / 64 + groups - 1) / groups : 0;
    int64_t fetched = 0;
    for (int64_t t = 0; t < m; t += 16) {
        const int64_t m0 = t + 16 <= m || m < 16 ? t : m - 16;
        const uint16_t *xt = x + m0 * k;
        __m512 out[16];
        for (int r = 0; r < 16; r++) out[r] = _mm512_setzero_ps();
        int64_t g = 0;
        for (; g + 3 < groups; g += 4) { /* four groups in flight in the tile unit */
            for (int64_t i = 0; i < 4 * lines && fetched < next_bytes; i++, fetched += 64)
                _mm_prefetch(next + fetched, _MM_HINT_T1);
            AMX_GROUP(0, 4, 6, xt + g * group, wb + g * group * 8);
            AMX_GROUP(1, 5, 7, xt + (g + 1) * group, wb + (g + 1) * group * 8);
            AMX_GROUP(2, 4, 6, xt + (g + 2) * group, wb + (g + 2) * group * 8);
            AMX_GROUP(3, 5, 7, xt + (g + 3) * group, wb + (g + 3) * group * 8);
            for (int j = 0; j < 4; j++)
                amx_fold(out, c[j], sb + (g + j) * 16, zb ? zb + (g + j) * 16 : NULL, xs, m0, m,
                         groups, g + j);
        }
        for (; g < groups; g++) {
            for (int64_t i = 0; i < lines && fetched < next_bytes; i++, fetched += 64)
                _mm_prefetch(next + fetched, _MM_HINT_T1);
            AMX_GROUP(0, 4, 6, xt + g * group, wb + g * group * 8);
            amx_fold(out, c[0], sb + g * 16, zb ? zb + g * 16 : NULL, xs, m0, m, groups, g);
        }
        const int64_t valid = m - m0 < 16 ? m - m0 : 16;
        for (int r = 0; r < valid; r++)
            _mm256_mask_storeu_epi16(y + (m0 + r) * y_stride + col, store_mask,
                                     (__m256i)_mm512_cvtneps_pbh(out[r]));
    }
}
#undef AMX_GROUP

/* Per-thread scratch for amx_block: wb (k / 2 pair rows of 64 bytes), sb and zb (groups x
 * 16 floats each), bytes per thread. */
static inline size_t amx_scratch_bytes(int64_t k, int64_t group) {
    return (size_t)(k / 2) * 64 + 2 * (size_t)(k / group) * 64;
}
#endif

/* A panel library's AMX controls, PREFIX_has_amx / _set_amx_rows / _amx_rows / _amx_calls,
 * over its own `amx_rows` (from this many rows its GEMM uses the tiles; 0: never, until the
 * loader enables them) and `amx_calls` (calls that ran in the tiles: tests check the
 * dispatch with it; the GEMM adds to it). */
#ifdef RADIXSERVE_AMX
#define RADIXSERVE_AMX_BUILT 1
#else
#define RADIXSERVE_AMX_BUILT 0
#endif
#define AMX_CONTROLS(PREFIX)                                                                \
    static int amx_rows = 0;                                                                \
    static int64_t amx_calls = 0;                                                           \
    int PREFIX##_has_amx(void) { return RADIXSERVE_AMX_BUILT; }                              \
    void PREFIX##_set_amx_rows(int rows) { amx_rows = rows; }                               \
    int PREFIX##_amx_rows(void) { return amx_rows; }                                        \
    int64_t PREFIX##_amx_calls(void) { return __atomic_load_n(&amx_calls, __ATOMIC_RELAXED); }
#endif
