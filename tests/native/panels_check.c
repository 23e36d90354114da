/* A stand-alone check of the panel GEMMs and dequantizers (int4_panels.c, int8_panels.c)
 * against a float64 reference, with no Python: tests/executor/test_kernel_tiers.py builds it
 * with each kernel tier's flags, for this machine and cross-compiled for aarch64 (run under
 * qemu-aarch64-static), so a tier's kernels are checked on an instruction set this machine
 * may not have. Layouts as executor/quant.py's to_panels and to_int8_panels write them.
 * Prints one line per case; exit status 1 when any output is off. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int int4_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint32_t *panels,
                          const uint16_t *sz, int64_t n, int64_t group, float *xs, int32_t *xp,
                          uint16_t *y, int64_t y_stride, int num_threads);
int int4_panels_dequant_bf16(const uint32_t *panels, const uint16_t *sz, int64_t k, int64_t group,
                             int64_t first_block, int64_t num_blocks, int num_threads,
                             uint16_t *out);
int int8_panels_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const int8_t *panels,
                          const uint16_t *scale, const uint16_t *zero, int64_t n, int64_t group,
                          float *xt, float *xs, uint16_t *y, int64_t y_stride, int num_threads);
int int8_panels_dequant_bf16(const int8_t *panels, const uint16_t *scale, const uint16_t *zero,
                             int64_t k, int64_t group, int64_t first_block, int64_t num_blocks,
                             int num_threads, uint16_t *out);
int int4_panels_has_gemm(void);

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) { /* xorshift64 */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 11);
}
static double uniform(void) { return (next() & 0xFFFFFF) / (double)0x1000000; } /* [0, 1) */

static double bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t to_bf16(float f) { /* to nearest even (finite values only here) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static double f16(uint16_t h) {
    const int e = (h >> 10) & 31, mant = h & 1023;
    const double v = e ? ldexp(1024 + mant, e - 25) : ldexp(mant, -24);
    return h & 0x8000 ? -v : v;
}
static uint16_t to_f16(double v) { /* a normal positive float16 near v (truncated) */
    int e;
    const double f = frexp(v, &e); /* v = f 2^e, f in [0.5, 1) */
    return (uint16_t)(((e + 14) << 10) | ((int)(f * 2048) & 1023));
}

static int failures = 0;

/* y [m][n] against ref: each within bfloat16's rounding of itself plus float32 sums' error */
static void compare(const char *what, int64_t m, int64_t n, const uint16_t *y, const double *ref) {
    double top = 0, worst = 0;
    for (int64_t i = 0; i < m * n; i++) top = fmax(top, fabs(ref[i]));
    int bad = 0;
    for (int64_t i = 0; i < m * n; i++) {
        const double err = fabs(bf16(y[i]) - ref[i]), allowed = ldexp(fabs(ref[i]), -8) + ldexp(top, -12);
        worst = fmax(worst, err / (allowed > 0 ? allowed : 1));
        bad += err > allowed;
    }
    printf("%-28s m=%-3lld %s (worst error %.2f of allowed)\n", what, (long long)m,
           bad ? "FAILED" : "ok", worst);
    failures += bad > 0;
}

static void check_int4(int64_t m, int64_t n, int64_t k, int64_t group) {
    const int64_t blocks = (n + 15) / 16, octets = k / 8, groups = k / group;
    uint8_t *q = malloc(n * k);
    uint16_t *x = malloc(m * k * 2), *y = malloc(m * n * 2), *sz = calloc(blocks * groups * 32, 2);
    uint32_t *panels = calloc(blocks * octets * 16, 4);
    double *w = malloc(n * k * sizeof(double)), *ref = calloc(m * n, sizeof(double));
    for (int64_t i = 0; i < n * k; i++) q[i] = next() & 15;
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t s = to_bf16((float)(0.01 + 0.02 * uniform())), z = to_bf16((float)(uniform() - 0.5) * 0.1f);
            sz[((j / 16) * groups + g) * 32 + j % 16] = s;
            sz[((j / 16) * groups + g) * 32 + 16 + j % 16] = z;
            for (int64_t i = g * group; i < (g + 1) * group; i++) w[j * k + i] = (q[j * k + i] - 8) * bf16(s) + bf16(z);
        }
    for (int64_t j = 0; j < n; j++)
        for (int64_t o = 0; o < octets; o++) {
            uint32_t word = 0;
            for (int u = 0; u < 4; u++)
                word |= (uint32_t)q[j * k + 8 * o + 2 * u] << (4 * u) |
                        (uint32_t)q[j * k + 8 * o + 2 * u + 1] << (16 + 4 * u);
            panels[((j / 16) * octets + o) * 16 + j % 16] = word;
        }
    for (int64_t i = 0; i < m * k; i++) x[i] = to_bf16((float)(2 * uniform() - 1));
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < k; i++) ref[r * n + j] += bf16(x[r * k + i]) * w[j * k + i];
    float *xs = malloc(m * groups * 4);
    int32_t *xp = malloc(m * k * 4); /* m * k 32-bit words */
    if (int4_panels_gemm_bf16(x, m, k, panels, sz, n, group, xs, xp, y, n, 2)) failures++;
    compare("int4 gemm", m, n, y, ref);
    uint16_t *wt = malloc(k * 16 * blocks * 2);
    if (m == 1) { /* the dequantizer: q s + (z - 8 s) in float32, rounded to bfloat16 */
        if (int4_panels_dequant_bf16(panels, sz, k, group, 0, blocks, 2, wt)) failures++;
        int bad = 0;
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < k; i++)
                bad += fabs(bf16(wt[i * 16 * blocks + j]) - w[j * k + i]) >
                       ldexp(fabs(w[j * k + i]), -8) + 1e-6;
        printf("%-28s %s\n", "int4 dequant", bad ? "FAILED" : "ok");
        failures += bad > 0;
    }
    free(q), free(x), free(y), free(sz), free(panels), free(w), free(ref), free(xs), free(xp), free(wt);
}

static void check_int8(int64_t m, int64_t n, int64_t k, int64_t group, int zeros) {
    const int64_t blocks = (n + 15) / 16, groups = k / group;
    int8_t *panels = calloc(blocks * k * 16, 1);
    uint16_t *x = malloc(m * k * 2), *y = malloc(m * n * 2);
    uint16_t *scale = calloc(blocks * groups * 16, 2), *zero = zeros ? calloc(blocks * groups * 16, 2) : NULL;
    double *w = malloc(n * k * sizeof(double)), *ref = calloc(m * n, sizeof(double));
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < groups; g++) {
            /* one subnormal scale (tiny blocks of a GGUF file), the rest normal */
            const uint16_t s = j == 0 && g == 0 ? 0x0123 : to_f16(0.001 + 0.01 * uniform());
            const uint16_t z = zeros ? to_f16(0.05 * uniform() + 0.01) : 0;
            scale[((j / 16) * groups + g) * 16 + j % 16] = s;
            if (zeros) zero[((j / 16) * groups + g) * 16 + j % 16] = z;
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                const int8_t c = (int8_t)(next() & 255);
                panels[((j / 16) * k + i) * 16 + j % 16] = c;
                w[j * k + i] = c * f16(s) + (zeros ? f16(z) : 0.0);
            }
        }
    for (int64_t i = 0; i < m * k; i++) x[i] = to_bf16((float)(2 * uniform() - 1));
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < k; i++) ref[r * n + j] += bf16(x[r * k + i]) * w[j * k + i];
    float *xt = malloc(m * k * 4), *xs = malloc(m * groups * 4);
    if (int8_panels_gemm_bf16(x, m, k, panels, scale, zero, n, group, xt, xs, y, n, 2)) failures++;
    compare(zeros ? "int8 gemm (zeros)" : "int8 gemm", m, n, y, ref);
    uint16_t *wt = malloc(k * 16 * blocks * 2);
    if (m == 1) {
        if (int8_panels_dequant_bf16(panels, scale, zero, k, group, 0, blocks, 2, wt)) failures++;
        int bad = 0;
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < k; i++) bad += wt[i * 16 * blocks + j] != to_bf16((float)w[j * k + i]);
        printf("%-28s %s\n", zeros ? "int8 dequant (zeros)" : "int8 dequant", bad ? "FAILED" : "ok");
        failures += bad > 0;
    }
    free(panels), free(x), free(y), free(scale), free(zero), free(w), free(ref), free(xt), free(xs), free(wt);
}

int main(void) {
    printf("panel GEMMs: %s path\n", int4_panels_has_gemm() == 1 ? "AVX-512 BF16" : "portable");
    const int64_t rows[] = {1, 2, 3, 4, 5, 9, 16};
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
        check_int4(rows[i], 100, 256, i % 3 == 0 ? 128 : i % 3 == 1 ? 32 : 64);
        check_int8(rows[i], 100, 256, 32, (int)(i % 2));
        check_int8(rows[i], 36, 128, 16, (int)(1 - i % 2));
    }
    printf("%s\n", failures ? "FAILED" : "all ok");
    return failures ? 1 : 0;
}
