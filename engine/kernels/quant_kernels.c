/* Weight-streaming GEMV for grouped integer weights with bfloat16 activations (llmctl's GroupedIntWeight),
 * built on first use by kernels/quant.py like cpu_kernels.c (-O3 -march=native -fopenmp) and called through
 * ctypes. An AVX-512 body (needs AVX512-BF16 for the 4-bit dot products) and an AVX2 + FMA + F16C body;
 * `quant_kernel_isa()` says which one was compiled (0: none, the engine keeps its torch paths).
 *
 *   y[r, o] = sum_i x[r, i] * (q[o, i] - zero[o, i / group]) * scale[o, i / group]  (+ bias[o])
 *
 * is computed per output row and group as  scale * (D - (zero + offset) * xsum)  with D = sum x * (q + offset)
 * and xsum the group's sum of x (computed once per call), so the codes only need widening, never a
 * subtraction per element. The 4-bit AVX-512 body gets q + 128 as a bfloat16 for free: the bits
 * 0x4300 | q are exactly the float 128 + q for q < 128, so one OR turns a widened code into a bf16 operand
 * of the dot-product instruction (offset 128). Everywhere else codes are widened to float32 (offset 0).
 *
 * Layouts (packed by kernels/quant.py):
 *   8-bit: codes uint8 [n, k] as they are;
 *   4-bit: uint8 [n, k / 2]; each 128 inputs in 64 bytes read as 32 little-endian 16-bit words, word w
 *          holding inputs w, 32 + w, 64 + w, 96 + w in its nibbles from the lowest up; a trailing 64
 *          inputs (k % 128 == 64) in 32 bytes, byte j = code[j] | code[j + 32] << 4.
 *   scales, zeros: float16 [n, groups] (zeros may be NULL: the midpoint 2^(bits-1)).
 * Threads split the output rows; each thread streams its rows' bytes once for all the x rows
 * (x rows are taken in chunks of MAX_ROWS, re-reading a weight row from L1 for the next chunk).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

INLINE uint16_t f32_to_bf16(float value) { /* round to nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Per call: x as float32 (for the float paths) and each row's per-group sums. */
typedef struct {
    float *xf;      /* [m, k] */
    float *xsum;    /* [m, padded]: zeros past the last group */
    int64_t padded; /* groups rounded up to 16, so the per-group loops need no tail */
} Prepared;

INLINE int64_t pad16(int64_t count) { return (count + 15) / 16 * 16; }

static int prepare(const uint16_t *x, int64_t m, int64_t k, int64_t group, int need_float, Prepared *p) {
    const int64_t groups = k / group;
    p->padded = pad16(groups);
    p->xf = need_float ? (float *)malloc(sizeof(float) * (size_t)(m * k)) : NULL;
    p->xsum = (float *)calloc((size_t)(m * p->padded), sizeof(float));
    if ((need_float && p->xf == NULL) || p->xsum == NULL) {
        free(p->xf), free(p->xsum);
        return 0;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) {
                const float v = bf16_to_f32(x[r * k + i]);
                sum += v;
                if (need_float) p->xf[r * k + i] = v;
            }
            p->xsum[r * p->padded + g] = sum;
        }
    return 1;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ISA 512
#define LANES 16
typedef __m512 vec;
INLINE vec vzero(void) { return _mm512_setzero_ps(); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
INLINE void vstore_bf16(uint16_t *p, vec v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
INLINE vec vset1(float v) { return _mm512_set1_ps(v); }
INLINE float vsum(vec v) { return _mm512_reduce_add_ps(v); }
INLINE vec vloadf(const float *p) { return _mm512_loadu_ps(p); }
INLINE vec vload_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA 256
#define LANES 8
typedef __m256 vec;
INLINE vec vzero(void) { return _mm256_setzero_ps(); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
INLINE vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
INLINE void vstore_bf16(uint16_t *p, vec v) {
    float values[8];
    _mm256_storeu_ps(values, v);
    for (int l = 0; l < 8; l++) p[l] = f32_to_bf16(values[l]);
}
INLINE vec vset1(float v) { return _mm256_set1_ps(v); }
INLINE float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
INLINE vec vloadf(const float *p) { return _mm256_loadu_ps(p); }
INLINE vec vload_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
#define ISA 0
#endif

int quant_kernel_isa(void) { return ISA; }

#if ISA

/* One output row's scales and zero points (plus the code offset) as float32, zero-padded to `padded`
 * groups: per group the kernels then broadcast a float from memory instead of converting a float16. */
typedef struct {
    float *scale, *zero;
} RowParams;

INLINE void load_row(const uint16_t *scales, const uint16_t *zeros, int64_t o, int64_t groups, float midpoint,
                     float offset, RowParams *row) {
    const uint16_t *s = scales + o * groups, *z = zeros != NULL ? zeros + o * groups : NULL;
    for (int64_t g = 0; g < groups; g++) {
        row->scale[g] = f16_to_f32(s[g]);
        row->zero[g] = (z != NULL ? f16_to_f32(z[g]) : midpoint) + offset;
    }
}

/* The x-sum correction of one output row: sum_g scale_g * (zero_g + offset) * xsum[g]. */
INLINE float correction(const RowParams *row, const float *xsum, int64_t padded) {
    vec total = vzero();
    for (int64_t g = 0; g < padded; g += LANES)
        total = vfma(vmul(vloadf(row->scale + g), vloadf(row->zero + g)), vloadf(xsum + g), total);
    return vsum(total);
}

INLINE void store_row(uint16_t *y, int64_t n, int64_t r, int64_t o, float value, const uint16_t *bias) {
    if (bias != NULL) value += bf16_to_f32(bias[o]);
    y[r * n + o] = f32_to_bf16(value);
}

/* A tile is R output rows against MR x rows; R * MR independent accumulators hide the latency of the
 * multiply-add chains (one row at a time ran at about a quarter of the speed: each 64-input block waited on
 * the previous block's dot product). */
#define ACC(i, r) acc[(i) * MR + (r)]

/* ---- 8 bits: codes widened to float32 ---------------------------------------------------------------- */
#define Q8_OFFSET 0.0f
INLINE void q8_tile(const uint8_t *codes, const RowParams *rp, const Prepared *p, const uint16_t *bias, uint16_t *y,
                    int64_t o, int64_t r0, const int R, const int MR, int64_t n, int64_t k, int64_t group) {
    const int64_t groups = k / group;
    vec acc[8], dot[8];
    for (int a = 0; a < R * MR; a++) acc[a] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        for (int a = 0; a < R * MR; a++) dot[a] = vzero();
        for (int64_t c = g * group; c < (g + 1) * group; c += LANES) {
            vec xs[4];
            for (int r = 0; r < MR; r++) xs[r] = vloadf(p->xf + (r0 + r) * k + c);
            for (int i = 0; i < R; i++) {
                const vec w = vload_u8(codes + (o + i) * k + c);
                for (int r = 0; r < MR; r++) dot[i * MR + r] = vfma(w, xs[r], dot[i * MR + r]);
            }
        }
        for (int i = 0; i < R; i++) {
            const vec scale = vset1(rp[i].scale[g]);
            for (int r = 0; r < MR; r++) ACC(i, r) = vfma(dot[i * MR + r], scale, ACC(i, r));
        }
    }
    for (int i = 0; i < R; i++)
        for (int r = 0; r < MR; r++)
            store_row(y, n, r0 + r, o + i, vsum(ACC(i, r)) - correction(&rp[i], p->xsum + (r0 + r) * p->padded, p->padded), bias);
}
#define Q8_LANES 8 /* R * MR */

/* ---- 4 bits ----------------------------------------------------------------------------------------------- */
/* One block's codes in input order (128 inputs, or the 64-input tail), portable. */
INLINE void q4_unpack_scalar(const uint8_t *bytes, int64_t inputs, uint8_t *codes) {
    if (inputs == 128) { /* word w holds inputs w, 32 + w, 64 + w, 96 + w in its four nibbles */
        for (int w = 0; w < 32; w++) {
            const unsigned word = (unsigned)bytes[2 * w] | (unsigned)bytes[2 * w + 1] << 8;
            for (int t = 0; t < 4; t++) codes[32 * t + w] = (uint8_t)((word >> (4 * t)) & 0xf);
        }
    } else { /* the 64-input tail: byte j holds inputs j and 32 + j */
        for (int j = 0; j < 32; j++) codes[j] = bytes[j] & 0xf, codes[32 + j] = bytes[j] >> 4;
    }
}

#if ISA == 512
#define Q4_OFFSET 128.0f
#define Q4_NEEDS_FLOAT 0
#define Q4_LANES 4
/* Inputs in chunks of 32; chunk t of a 128-input block is nibble t of each of its 32 words, so one
 * shift and one ternary-logic op ((w >> 4t) & 0xf | 0x4300) give the 32 bf16 operands 128 + q: 11 ops per
 * 128 inputs with the dot products, where widening bytes (cvtepu8) took 18 and ran at two thirds the speed. */
INLINE __m512bh q4_chunk(__m512i words, const int t) {
    const __m512i shifted = t ? _mm512_srli_epi16(words, 4 * t) : words;
    return (__m512bh)_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(0x000f), _mm512_set1_epi16(0x4300), 0xea);
}
/* A trailing 64 inputs (k % 128 == 64) are 32 bytes, byte j = code[j] | code[j + 32] << 4. */
INLINE __m512bh q4_tail_chunk(const uint8_t *bytes, const int t) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)bytes);
    if (t) raw = _mm256_srli_epi16(raw, 4);
    return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(raw, _mm256_set1_epi8(0x0f))),
                                     _mm512_set1_epi16(0x4300));
}
INLINE __m512bh load_x32(const uint16_t *x) { return (__m512bh)_mm512_loadu_si512((const void *)x); }

INLINE void q4_tile(const uint8_t *packed, const RowParams *rp, const uint16_t *x, const Prepared *p,
                    const uint16_t *bias, uint16_t *y, int64_t o, int64_t r0, const int R, const int MR, int64_t n,
                    int64_t k, int64_t group) {
    const int64_t chunks_per_group = group / 32, full_blocks = k / 128;
    __m512 acc[4], dot[2][4];
    for (int a = 0; a < R * MR; a++) acc[a] = dot[0][a] = dot[1][a] = _mm512_setzero_ps();
#define Q4_CHUNK(operand_expr, chunk)                                                                   \
    do {                                                                                                \
        const int64_t j = (chunk);                                                                      \
        __m512bh xs[4];                                                                                 \
        for (int r = 0; r < MR; r++) xs[r] = load_x32(x + (r0 + r) * k + j * 32);                       \
        for (int i = 0; i < R; i++) {                                                                   \
            const __m512bh w = operand_expr;                                                            \
            for (int r = 0; r < MR; r++) dot[j & 1][i * MR + r] = _mm512_dpbf16_ps(dot[j & 1][i * MR + r], w, xs[r]); \
        }                                                                                               \
        if ((j + 1) % chunks_per_group == 0) {                                                          \
            const int64_t g = j / chunks_per_group;                                                     \
            for (int i = 0; i < R; i++) {                                                               \
                const __m512 scale = _mm512_set1_ps(rp[i].scale[g]);                                    \
                for (int r = 0; r < MR; r++) {                                                          \
                    const int a = i * MR + r;                                                           \
                    acc[a] = _mm512_fmadd_ps(_mm512_add_ps(dot[0][a], dot[1][a]), scale, acc[a]);       \
                    dot[0][a] = dot[1][a] = _mm512_setzero_ps();                                        \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    } while (0)
    for (int64_t b = 0; b < full_blocks; b++) {
        __m512i words[4];
        for (int i = 0; i < R; i++) words[i] = _mm512_loadu_si512((const void *)(packed + (o + i) * (k / 2) + b * 64));
        Q4_CHUNK(q4_chunk(words[i], 0), 4 * b);
        Q4_CHUNK(q4_chunk(words[i], 1), 4 * b + 1);
        Q4_CHUNK(q4_chunk(words[i], 2), 4 * b + 2);
        Q4_CHUNK(q4_chunk(words[i], 3), 4 * b + 3);
    }
    if (k % 128) {
        Q4_CHUNK(q4_tail_chunk(packed + (o + i) * (k / 2) + full_blocks * 64, 0), 4 * full_blocks);
        Q4_CHUNK(q4_tail_chunk(packed + (o + i) * (k / 2) + full_blocks * 64, 1), 4 * full_blocks + 1);
    }
#undef Q4_CHUNK
    for (int i = 0; i < R; i++)
        for (int r = 0; r < MR; r++)
            store_row(y, n, r0 + r, o + i, _mm512_reduce_add_ps(ACC(i, r)) - correction(&rp[i], p->xsum + (r0 + r) * p->padded, p->padded), bias);
}
#else
#define Q4_OFFSET 0.0f
#define Q4_NEEDS_FLOAT 1
#define Q4_LANES 4
/* AVX2: each block's nibbles go to a buffer in input order and are widened 8 at a time. */
#define q4_unpack q4_unpack_scalar

INLINE void q4_tile(const uint8_t *packed, const RowParams *rp, const uint16_t *x, const Prepared *p,
                    const uint16_t *bias, uint16_t *y, int64_t o, int64_t r0, const int R, const int MR, int64_t n,
                    int64_t k, int64_t group) {
    (void)x;
    __m256 acc[4], dot[4];
    uint8_t unpacked[4][128] __attribute__((aligned(32)));
    for (int a = 0; a < R * MR; a++) acc[a] = dot[a] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 128) {
        const int64_t inputs = k - c >= 128 ? 128 : 64;
        for (int i = 0; i < R; i++) q4_unpack(packed + (o + i) * (k / 2) + c / 2, inputs, unpacked[i]);
        for (int64_t j = 0; j < inputs; j += 8) {
            for (int i = 0; i < R; i++) {
                const __m256 w = vload_u8(unpacked[i] + j);
                for (int r = 0; r < MR; r++) dot[i * MR + r] = _mm256_fmadd_ps(w, vloadf(p->xf + (r0 + r) * k + c + j), dot[i * MR + r]);
            }
            if ((c + j + 8) % group == 0)
                for (int i = 0; i < R; i++) {
                    const __m256 scale = _mm256_set1_ps(rp[i].scale[(c + j) / group]);
                    for (int r = 0; r < MR; r++)
                        ACC(i, r) = _mm256_fmadd_ps(dot[i * MR + r], scale, ACC(i, r)), dot[i * MR + r] = _mm256_setzero_ps();
                }
        }
    }
    for (int i = 0; i < R; i++)
        for (int r = 0; r < MR; r++)
            store_row(y, n, r0 + r, o + i, vsum(ACC(i, r)) - correction(&rp[i], p->xsum + (r0 + r) * p->padded, p->padded), bias);
}
#endif

/* x rows per pass: 4, 2 or 1 (the largest that fits the remaining rows) */
INLINE int x_rows(int64_t remaining) { return remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1; }

/* Output rows one tile call covers: `lanes` accumulators shared among MR x rows. */
INLINE int64_t tile_rows(int lanes, int MR) { return MR == 4 ? (lanes >= 8 ? 2 : 1) : lanes / MR; }

/* The tile function with constant shapes (so its loops unroll): a full tile, or one row of a short one. */
#define TILE_SHAPES(call, lanes)                                                          \
    do {                                                                                  \
        if (!full) {                                                                      \
            if (MR == 4) call(1, 4); else if (MR == 2) call(1, 2); else call(1, 1);      \
        } else if (MR == 4) call((lanes) >= 8 ? 2 : 1, 4);                               \
        else if (MR == 2) call((lanes) / 2, 2);                                          \
        else call(lanes, 1);                                                              \
    } while (0)

/* Returns 0 (nothing computed) for shapes the layouts do not cover; the caller checks them first. */
int quant_gemv_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || n < 1 || group < 1 || k % group) return 0;
    if (bits == 8 ? group % LANES != 0 : (bits != 4 || k % 64 || (group != 32 && group % 64))) return 0;
    Prepared p;
    if (!prepare((const uint16_t *)x, m, k, group, bits == 8 || Q4_NEEDS_FLOAT, &p)) return 0;
    const int64_t groups = k / group;
    const float midpoint = bits == 8 ? 128.0f : 8.0f, offset = bits == 8 ? Q8_OFFSET : Q4_OFFSET;
    const int lanes = bits == 8 ? Q8_LANES : Q4_LANES;
    const int64_t tile = lanes; /* output rows per tile (each call takes lanes / MR of them) */
    const int64_t tiles = (n + tile - 1) / tile;
    const uint16_t *b = (const uint16_t *)bias;
    uint16_t *out = (uint16_t *)y;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        RowParams rp[8];
        for (int i = 0; i < 8; i++) {
            rp[i].scale = (float *)calloc((size_t)p.padded, sizeof(float));
            rp[i].zero = (float *)calloc((size_t)p.padded, sizeof(float));
            failed |= rp[i].scale == NULL || rp[i].zero == NULL;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            const int64_t first = t * tile, rows = n - first < tile ? n - first : tile;
            for (int64_t i = 0; i < rows; i++)
                load_row((const uint16_t *)scales, (const uint16_t *)zeros, first + i, groups, midpoint, offset, &rp[i]);
            const int full = rows == tile;
            for (int64_t r0 = 0; r0 < m;) {
                const int MR = x_rows(m - r0);
                const int64_t step = full ? tile_rows(lanes, MR) : 1;
                for (int64_t o = first; o < first + rows; o += step) {
                    const RowParams *params = &rp[o - first];
                    if (bits == 8) {
#define Q8(RR, M) q8_tile((const uint8_t *)weight, params, &p, b, out, o, r0, RR, M, n, k, group)
                        TILE_SHAPES(Q8, Q8_LANES);
                    } else {
#define Q4(RR, M) q4_tile((const uint8_t *)weight, params, (const uint16_t *)x, &p, b, out, o, r0, RR, M, n, k, group)
                        TILE_SHAPES(Q4, Q4_LANES);
                    }
                }
                r0 += MR;
            }
        }
        for (int i = 0; i < 8; i++) free(rp[i].scale), free(rp[i].zero);
    }
    free(p.xf), free(p.xsum);
    return !failed;
}

/* The weight itself, w = (q - zero) * scale rounded to bf16 [n, k]: for many rows, one GEMM on it beats
 * the GEMV's per-row work (see NATIVE_MAX_ROWS in layers/quantization.py). Returns 0 for shapes the layouts
 * do not cover. */
int quant_dequantize_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                          int64_t k, int64_t group, int num_threads) {
    if (n < 1 || group < 1 || k % group) return 0;
    if (bits == 8 ? group % LANES != 0 : (bits != 4 || k % 64 || (group != 32 && group % 64))) return 0;
    const int64_t groups = k / group;
    const float midpoint = bits == 8 ? 128.0f : 8.0f;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t o = 0; o < n; o++) {
        uint8_t unpacked[128] __attribute__((aligned(32)));
        const uint8_t *row = (const uint8_t *)weight + o * (bits == 8 ? k : k / 2);
        uint16_t *dst = (uint16_t *)out + o * k;
        for (int64_t c = 0; c < k; c += bits == 8 ? 128 : (k - c >= 128 ? 128 : 64)) {
            const int64_t inputs = bits == 8 ? (k - c >= 128 ? 128 : k - c) : (k - c >= 128 ? 128 : 64);
            const uint8_t *codes = row + c;
            if (bits == 4) {
                q4_unpack_scalar(row + c / 2, inputs, unpacked);
                codes = unpacked;
            }
            for (int64_t j = 0; j < inputs; j += LANES) {
                const int64_t g = (c + j) / group;
                const float scale = f16_to_f32(((const uint16_t *)scales)[o * groups + g]);
                const float zero = zeros != NULL ? f16_to_f32(((const uint16_t *)zeros)[o * groups + g]) : midpoint;
                vstore_bf16(dst + c + j, vmul(vsub(vload_u8(codes + j), vset1(zero)), vset1(scale)));
            }
        }
    }
    return 1;
}

#else
int quant_gemv_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0;
}
#endif
