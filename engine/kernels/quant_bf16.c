/* bf16 from quantised weights: the weight dequantised (quant_dequantize_bf16), and on CPUs with AVX512-BF16 and no AMX
 * the dequantising GEMM for many rows (quant_gemm_bf16). */
#include "quant_simd.h"

#if ISA
/* One code of the layout: row i (of its block) at input j of chunk `chunk` (its 64 bytes; 6 bits: its 48;
 * IQ4_CODES: its 32). */
INLINE uint32_t layout_code(const uint8_t *chunk, int64_t i, int64_t j, int bits) {
    if (bits == 6 || bits == IQ4_CODES) { /* byte 2e + t of row i's lane (e = j & 1, t = j >> 1): a nibble (and two
                                             high bits, or the nibble indexes the grid) */
        const int64_t at = 4 * i + 2 * (j & 1) + (j >> 1);
        const uint32_t low = (chunk[at / 2] >> (4 * (at & 1))) & 0xf;
        if (bits == IQ4_CODES) return IQ4_GRID[low];
        return low | ((uint32_t)(chunk[32 + i] >> (2 * (at & 3))) & 3u) << 4;
    }
    const uint8_t *lane = chunk + 4 * i; /* words 2i (e = 0) and 2i + 1 (e = 1) */
    const uint32_t word = (uint32_t)lane[2 * (j & 1)] | (uint32_t)lane[2 * (j & 1) + 1] << 8;
    return (word >> (bits * (j >> 1))) & ((1u << bits) - 1);
}

#if ISA == 512
#if defined(__AVX512BF16__)
INLINE __m256i bf16_of(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
/* AVX-512 CPUs without AVX512-BF16 (Skylake-X to Ice Lake) round as f32_to_bf16 does (vcvtneps2bf16 also flushes
 * subnormals to zero) */
INLINE __m256i bf16_of(__m512 v) { return round_bf16_exact(v); }
#endif

/* 16 vectors of 16 floats transposed in place (v[i][j] <- v[j][i]): four rounds of lane shuffles (a gather per 16
 * outputs was most of the dequantisation). */
INLINE void transpose_16x16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int h = 0; h < 2; h++) {
            v[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
            v[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
        }
    for (int i = 0; i < 16; i += 8)
        for (int h = 0; h < 4; h++) {
            t[i + h] = _mm512_shuffle_f32x4(v[i + h], v[i + 4 + h], 0x88);
            t[i + 4 + h] = _mm512_shuffle_f32x4(v[i + h], v[i + 4 + h], 0xdd);
        }
    for (int h = 0; h < 8; h++) {
        v[h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0x88);
        v[8 + h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0xdd);
    }
}
#endif

/* The weight itself, w = (q - zero) * scale rounded to bf16 [n, k]: for many rows, one GEMM on it can beat
 * the GEMV's per-row work (see NATIVE_MAX_ROWS in layers/quantization.py). Per 16-row block the weight is
 * dequantised with rows in the lanes (16 values per input) into a float buffer [k, 16], then each output
 * row gathers its 16 inputs at a time from it. Returns 0 for shapes the layout does not cover. */
int quant_dequantize_bf16(const void *weight, const void *scales_, const void *zeros_, int bits, void *out, int64_t n,
                          int64_t k, int64_t group, int num_threads) {
    if (!covered(bits, n, k, group)) return 0;
    const uint8_t *codes = (const uint8_t *)weight;
    const uint16_t *scales = (const uint16_t *)scales_, *zeros = (const uint16_t *)zeros_;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, step = step_of(bits), chunks = k / step, groups = k / group;
    const int64_t bytes = chunk_bytes(bits);
    const float midpoint = midpoint_of(bits);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *columns = (float *)malloc(sizeof(float) * (size_t)(k * BLOCK)); /* [k, 16] */
        failed |= columns == NULL;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            if (columns == NULL) continue;
            const int64_t rows = n - block * BLOCK < BLOCK ? n - block * BLOCK : BLOCK;
            const uint8_t *base = codes + block * chunks * bytes;
#if ISA == 512
            const __m512i mask = _mm512_set1_epi32((1 << code_bits(bits)) - 1);
            const int width = bits == 4 ? 4 : 8; /* bits a code takes in its word */
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = (block * groups + g) * BLOCK;
                const __m512 scale = fload_f16(scales + at);
                const __m512 zero = zeros != NULL ? fload_f16(zeros + at) : fset1(midpoint);
                for (int64_t c = g * group / step; c < (g + 1) * group / step; c++) {
                    /* lane i: words 2i, 2i + 1 */
                    const __m512i lanes = load_words(bits, base + c * bytes, 0);
                    for (int j = 0; j < step; j++) {
                        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(lanes, 16 * (j & 1) + width * (j >> 1)), mask);
                        _mm512_storeu_ps(columns + (c * step + j) * BLOCK,
                                         _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), zero), scale));
                    }
                }
            }
            int64_t j = 0;
            for (; j + 16 <= k; j += 16) {
                __m512 tile[16];
                for (int t = 0; t < 16; t++) tile[t] = _mm512_loadu_ps(columns + (j + t) * BLOCK);
                transpose_16x16(tile);
                for (int64_t i = 0; i < rows; i++)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + (block * BLOCK + i) * k + j), bf16_of(tile[i]));
            }
            for (int64_t i = 0; i < rows; i++) {
                uint16_t *dst = (uint16_t *)out + (block * BLOCK + i) * k;
                for (int64_t tail = j; tail < k; tail++) dst[tail] = f32_to_bf16(columns[tail * BLOCK + i]);
            }
#else
            for (int64_t g = 0; g < groups; g++)
                for (int64_t i = 0; i < rows; i++) {
                    const int64_t at = (block * groups + g) * BLOCK + i;
                    const float scale = _cvtsh_ss(scales[at]), zero = zeros != NULL ? _cvtsh_ss(zeros[at]) : midpoint;
                    for (int64_t c = g * group / step; c < (g + 1) * group / step; c++)
                        for (int64_t j = 0; j < step; j++)
                            columns[(c * step + j) * BLOCK + i] = ((float)layout_code(base + c * bytes, i, j, bits) - zero) * scale;
                }
            for (int64_t i = 0; i < rows; i++) {
                uint16_t *dst = (uint16_t *)out + (block * BLOCK + i) * k;
                for (int64_t j = 0; j < k; j++) dst[j] = f32_to_bf16(columns[j * BLOCK + i]);
            }
#endif
        }
        free(columns);
    }
    return !failed;
}


#else
int quant_dequantize_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                          int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)out, (void)n, (void)k, (void)group, (void)num_threads;
    return 0;
}
#endif

/* ---- AVX512-BF16 without AMX: the weight dequantised a pair of blocks at a time, then every row against it ----
 * y = x W^T (+ bias) for many rows on CPUs with AVX512-BF16 and no AMX (Zen 4 and 5): per pair of 16-row blocks
 * the codes become bf16 input pairs, bitwise quant_dequantize_bf16's weights ((q - zero) * scale in float32, or
 * one fused multiply-add where the midpoint makes it the same rounding, then nearest even), 16 outputs x 2
 * inputs a vector in a per-thread buffer (L1/L2), and every row of the call runs against them 8 at a time:
 * vdpbf16ps with x's own bf16 pairs broadcast, 16 float accumulators in named registers, one per (row, output)
 * over the inputs in order, then the bias and one rounding. No int16 x and no per-group epilogue, which
 * cost the GEMV's wide tiles most with 4-bit codes in groups of 32; each row's outputs depend on that row only. */
#if ISA == 512 && defined(__AVX512BF16__)

int quant_bf16_gemm_available(void) { return 1; }


/* 16 floats each of two inputs (a: the even one) as bf16 pairs: lane i = bf16(a_i) | bf16(b_i) << 16 */
INLINE __m512i bf16_pairs(__m512 a, __m512 b) {
    const __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a)), order,
                                     _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(b)));
}

/* An int16 pair vector (lane i: row i's codes of two neighbouring inputs) dequantised to bf16 pairs; `offset`
 * (symmetric codes only) is zero * scale. */
INLINE __m512i dequantize_pairs(__m512i codes, __m512 scale, __m512 zero, __m512 offset, int symmetric) {
    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(0xffff)));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 16));
    if (symmetric) /* zero * scale is exact (a power of two times scale): (q - zero) * scale in one rounding */
        return bf16_pairs(_mm512_fmsub_ps(even, scale, offset), _mm512_fmsub_ps(odd, scale, offset));
    return bf16_pairs(_mm512_mul_ps(_mm512_sub_ps(even, zero), scale), _mm512_mul_ps(_mm512_sub_ps(odd, zero), scale));
}

/* Block `block`'s codes as bf16 input pairs: pairs [k / 2][16] (pair j: inputs 2j, 2j + 1). */
static void dequantize_block_pairs(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                                   int64_t block, int64_t k, int64_t group, __m512i *pairs) {
    const int64_t step = step_of(bits), chunks = k / step, groups = k / group, chunks_per_group = group / step;
    const int64_t bytes = chunk_bytes(bits);
    const __m512i low8 = _mm512_set1_epi16(0x00ff), low4 = _mm512_set1_epi16(0x000f);
    const __m512 midpoint = _mm512_set1_ps(midpoint_of(bits));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = (block * groups + g) * BLOCK;
        const __m512 scale = fload_f16(scales + at), zero = zeros != NULL ? fload_f16(zeros + at) : midpoint;
        const __m512 offset = _mm512_mul_ps(zero, scale);
        for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; c++) {
            const uint8_t *chunk = codes + (block * chunks + c) * bytes;
            const __m512i words = load_words(bits, chunk, 0);
            if (bits != 4) { /* low bytes: inputs 4c, 4c + 1; high bytes: 4c + 2, 4c + 3 */
                pairs[2 * c] = dequantize_pairs(_mm512_and_si512(words, low8), scale, zero, offset, zeros == NULL);
                pairs[2 * c + 1] = dequantize_pairs(_mm512_srli_epi16(words, 8), scale, zero, offset, zeros == NULL);
            } else { /* nibble t: inputs 8c + 2t, 8c + 2t + 1 */
                for (int t = 0; t < 4; t++)
                    pairs[4 * c + t] = dequantize_pairs(_mm512_and_si512(_mm512_srli_epi16(words, 4 * t), low4), scale,
                                                        zero, offset, zeros == NULL);
            }
        }
    }
}

/* Rows [r0, r0 + rows) (rows <= 8; x packed as xw [k / 2][8] bf16 pairs, zero past m) against blocks b0 and b1
 * (b1 may repeat b0: then only b0 is stored). Meanwhile `ahead` (the next pair's codes, then its scales, each
 * contiguous) is prefetched a line an input pair, so their reads from DRAM overlap these dot products instead of
 * stalling the next dequantisation. */
typedef struct {
    const uint8_t *codes, *scales;
    int64_t code_lines, scale_lines;
} Ahead;

static void bf16_tile(const __m512i *pairs0, const __m512i *pairs1, const uint32_t *xw, const uint16_t *bias,
                      uint16_t *y, int64_t b0, int64_t b1, int64_t r0, int64_t rows, int64_t n, int64_t k,
                      const Ahead *ahead) {
#define BF16_ZERO(r) __m512 a0_##r = _mm512_setzero_ps(), a1_##r = _mm512_setzero_ps();
    WIDE_ROWS(BF16_ZERO)
#define BF16_DOT(r)                                                                                      \
    {                                                                                                    \
        const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)xs[r]);                                     \
        a0_##r = _mm512_dpbf16_ps(a0_##r, w0, xr), a1_##r = _mm512_dpbf16_ps(a1_##r, w1, xr);            \
    }
    for (int64_t j = 0; j < k / 2; j++) {
        const uint32_t *xs = xw + j * WIDE_MR;
        if (ahead != NULL) {
            if (j < ahead->code_lines) _mm_prefetch((const char *)(ahead->codes + CHUNK * j), _MM_HINT_T0);
            else if (j - ahead->code_lines < ahead->scale_lines)
                _mm_prefetch((const char *)(ahead->scales + CHUNK * (j - ahead->code_lines)), _MM_HINT_T0);
        }
        const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(pairs0 + j));
        const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(pairs1 + j));
        WIDE_ROWS(BF16_DOT)
    }
#define BF16_STORE(r)                                                                                    \
    if (r < rows) {                                                                                      \
        store_rows(y + (r0 + r) * n, bias, b0 * BLOCK, n, a0_##r);                                       \
        if (b1 != b0) store_rows(y + (r0 + r) * n, bias, b1 * BLOCK, n, a1_##r);                         \
    }
    WIDE_ROWS(BF16_STORE)
}

/* Rows [r0, r0 + 8) of x (bf16 pairs, pairs_per_row a row; rows from m on read as zero) as xw [pair][8 rows]: eight
 * pairs of each row at a time, transposed 8 x 8 in registers (a scalar copy and calloc's zeroing were a tenth of the
 * GEMM at 576 outputs). */
static void pack_row_group(const uint32_t *x, uint32_t *xw, int64_t r0, int64_t m, int64_t pairs_per_row) {
    for (int64_t j = 0; j < pairs_per_row; j += 8) {
        const int64_t live = pairs_per_row - j < 8 ? pairs_per_row - j : 8;
        const __mmask8 columns = (__mmask8)((1u << live) - 1);
        __m256i v[8];
        for (int r = 0; r < 8; r++)
            v[r] = r0 + r < m ? _mm256_maskz_loadu_epi32(columns, x + (r0 + r) * pairs_per_row + j) : _mm256_setzero_si256();
        const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
        const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
        const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
        const __m256i u[8] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),  /* columns 0|4, 1|5 */
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3),  /* 2|6, 3|7 of rows 0-3 */
                              _mm256_unpacklo_epi64(t4, t6), _mm256_unpackhi_epi64(t4, t6),
                              _mm256_unpacklo_epi64(t5, t7), _mm256_unpackhi_epi64(t5, t7)}; /* ... of rows 4-7 */
        for (int c = 0; c < live; c++) /* column c: the 128-bit halves holding it, rows 0-3 then 4-7 */
            _mm256_storeu_si256((__m256i *)(xw + (j + c) * WIDE_MR),
                                c < 4 ? _mm256_permute2x128_si256(u[c], u[4 + c], 0x20)
                                      : _mm256_permute2x128_si256(u[c - 4], u[c], 0x31));
    }
}

/* Returns 0 (nothing computed) for shapes the layout does not cover or without memory. */
int quant_gemm_bf16(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x_,
                    const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !covered(bits, n, k, group)) return 0;
    const uint8_t *codes = (const uint8_t *)weight;
    const uint16_t *scales = (const uint16_t *)scales_, *zeros = (const uint16_t *)zeros_;
    const uint16_t *bias = (const uint16_t *)bias_;
    const uint32_t *x = (const uint32_t *)x_; /* bf16 pairs */
    uint16_t *y = (uint16_t *)y_;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs_per_row = k / 2, row_groups = (m + WIDE_MR - 1) / WIDE_MR;
    const int64_t groups = k / group, chunks = k / step_of(bits), bytes = chunk_bytes(bits);
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > (blocks + 1) / 2 ? (blocks + 1) / 2 : num_threads);
    /* x as [row group][pair][8 rows] bf16 pairs, zero past m */
    uint32_t *xw = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(row_groups * pairs_per_row * WIDE_MR));
    if (xw == NULL) return 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < row_groups; g++)
            pack_row_group(x, xw + g * pairs_per_row * WIDE_MR, g * WIDE_MR, m, pairs_per_row);
        const int64_t me = omp_get_thread_num(), block_pairs = (blocks + 1) / 2;
        const int64_t first = block_pairs * me / threads, last = block_pairs * (me + 1) / threads;
        __m512i *pairs = (__m512i *)aligned_alloc(64, sizeof(__m512i) * (size_t)(2 * pairs_per_row));
        failed |= pairs == NULL;
        for (int64_t pair = first; pair < last && pairs != NULL; pair++) {
            const int64_t b0 = 2 * pair, b1 = b0 + 1 < blocks ? b0 + 1 : b0;
            dequantize_block_pairs(bits, codes, scales, zeros, b0, k, group, pairs);
            dequantize_block_pairs(bits, codes, scales, zeros, b1, k, group, pairs + pairs_per_row);
            const int64_t next = pair + 1 < last ? 2 * (pair + 1) : b0, next_blocks = next + 1 < blocks ? 2 : 1;
            const Ahead ahead = {codes + next * chunks * bytes, (const uint8_t *)(scales + next * groups * BLOCK),
                                 next_blocks * chunks * bytes / CHUNK, next_blocks * groups * BLOCK * 2 / CHUNK};
            for (int64_t g = 0; g < row_groups; g++) {
                const int64_t rows = m - g * WIDE_MR < WIDE_MR ? m - g * WIDE_MR : WIDE_MR;
                bf16_tile(pairs, pairs + pairs_per_row, xw + g * pairs_per_row * WIDE_MR, bias, y, b0, b1,
                          g * WIDE_MR, rows, n, k, g == 0 && next != b0 ? &ahead : NULL);
            }
        }
        free(pairs);
    }
    free(xw);
    return !failed;
}

#else
int quant_bf16_gemm_available(void) { return 0; }
int quant_gemm_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0;
}
#endif
