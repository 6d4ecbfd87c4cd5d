/* Weight-streaming GEMV for grouped integer weights with bfloat16 activations (llmctl's GroupedIntWeight),
 * built on first use by kernels/quant.py like cpu_kernels.c (-O3 -march=native -fopenmp) and called through
 * ctypes. An AVX-512 body (AVX512-BW; VNNI where the CPU has it) and an AVX2 + FMA + F16C body share one
 * layout; `quant_kernel_isa()` says which one was compiled (0: none, the engine keeps its torch paths).
 *
 *   y[r, o] = sum_i x[r, i] * (q[o, i] - zero[o, i / group]) * scale[o, i / group]  (+ bias[o])
 *
 * Layout (tinygemm's idea: output rows interleaved, so one vector holds 16 output rows and no horizontal
 * sums are needed). The output rows go in blocks of 16 (the last block padded with zero-scale rows); a
 * block's codes are chunks of 64 bytes, each 16 rows x STEP inputs read as 32 little-endian 16-bit words,
 * word 2i + e belonging to row i:
 *   8 bits (STEP 4):  low byte = input 4c + e, high byte = input 4c + 2 + e;
 *   4 bits (STEP 8):  nibble t (from the lowest) = input 8c + 2t + e.
 * codes uint8 [blocks, k / STEP, 64]; scales and zeros float16 [blocks, groups, 16] (zeros may be NULL: the
 * midpoint 2^(bits-1)). A masked shift turns a chunk into words whose lane i pair (e = 0, 1) is row i's
 * codes of two neighbouring inputs, so one int16 pair dot product (vpdpwssd: 16 rows x 2 inputs) takes
 * x[2j], x[2j+1] broadcast as one 32-bit word.
 *
 * Activations: converted once per call to int16 per x block (B inputs inside one weight group, B <= 256),
 * xq = round(x * 32767 / max|x_block|): an element's error is at most 2^-16 of its block's largest, far
 * below bf16's own 2^-9 of each element. Per block and 16 rows the int32 dot products D = sum xq * q then
 * give  scale * xscale * (D - zero * sum xq)  (exact integers up to the float conversion).
 * Threads split the 16-row blocks; each thread streams its blocks once for all the x rows (x rows taken
 * MR at a time, re-reading a tile of blocks from L1/L2 for the next rows).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define BLOCK 16      /* output rows per block */
#define CHUNK 64      /* bytes per chunk */
#define X_BLOCK_MAX 256 /* 255 * 32767 * 256 < 2^31: the int32 dot products cannot overflow */
/* Each stream of a tile prefetched this many chunks ahead: cold 3072x576 at M=1, one thread, 4-bit g32 116
 * -> 98-103 µs, 8-bit 142 -> 128-134 µs (a plain read of the same bytes: 128 µs); 4 and 32 chunks did worse. */
#define PREFETCH_CHUNKS 8

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

INLINE int64_t step_of(int bits) { return bits == 8 ? 4 : 8; }

/* Inputs per x block: the group itself up to X_BLOCK_MAX, else its largest divisor that fits and is whole
 * chunks (0: none). */
static int64_t x_block_of(int64_t group, int bits) {
    const int64_t step = step_of(bits);
    if (group <= X_BLOCK_MAX) return group;
    for (int64_t size = X_BLOCK_MAX; size >= step; size -= step)
        if (group % size == 0 && size % step == 0) return size;
    return 0;
}

/* Whether the layout covers this shape (the Python side checks first and explains). */
static int covered(int bits, int64_t n, int64_t k, int64_t group) {
    if ((bits != 4 && bits != 8) || n < 1 || group < 1 || k < 1 || k % group) return 0;
    return group % step_of(bits) == 0 && x_block_of(group, bits) > 0;
}

/* Per call: x as int16 per x block, with each block's scale and code sum. */
typedef struct {
    int16_t *xq;     /* [m, k] */
    float *xscale;   /* [m, x_blocks] */
    float *xsum;     /* [m, x_blocks] (exact integers) */
    int64_t x_block, x_blocks;
} Prepared;

static int prepare(const uint16_t *x, int64_t m, int64_t k, int64_t x_block, Prepared *p) {
    p->x_block = x_block, p->x_blocks = k / x_block;
    p->xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k));
    p->xscale = (float *)malloc(sizeof(float) * (size_t)(m * p->x_blocks));
    p->xsum = (float *)malloc(sizeof(float) * (size_t)(m * p->x_blocks));
    if (p->xq == NULL || p->xscale == NULL || p->xsum == NULL) {
        free(p->xq), free(p->xscale), free(p->xsum);
        return 0;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < p->x_blocks; b++) {
            const uint16_t *src = x + r * k + b * x_block;
            int16_t *dst = p->xq + r * k + b * x_block;
            float top = 0.0f;
            for (int64_t i = 0; i < x_block; i++) top = fmaxf(top, fabsf(bf16_to_f32(src[i])));
            const float inverse = top > 0.0f && top <= 3.0e38f ? 32767.0f / top : 0.0f;
            int32_t sum = 0;
            for (int64_t i = 0; i < x_block; i++) {
                const int32_t q = (int32_t)lrintf(bf16_to_f32(src[i]) * inverse);
                dst[i] = (int16_t)q, sum += q;
            }
            p->xscale[r * p->x_blocks + b] = inverse > 0.0f ? top / 32767.0f : 0.0f;
            p->xsum[r * p->x_blocks + b] = (float)sum;
        }
    return 1;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ISA 512
#define LANES 16
#define HALVES 1 /* vectors per 16-row block */
#define TILE 8 /* (row blocks x x rows) per tile: independent accumulator chains */
typedef __m512i ivec;
typedef __m512 fvec;
INLINE ivec iload(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE ivec iset16(short v) { return _mm512_set1_epi16(v); }
INLINE ivec iand(ivec a, ivec b) { return _mm512_and_si512(a, b); }
INLINE ivec isrl16(ivec a, int count) { return _mm512_srli_epi16(a, count); }
INLINE ivec izero(void) { return _mm512_setzero_si512(); }
INLINE ivec ipair(const int16_t *x) { int32_t v; memcpy(&v, x, 4); return _mm512_set1_epi32(v); }
#if defined(__AVX512VNNI__)
INLINE ivec idot(ivec acc, ivec w, ivec x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
INLINE ivec idot(ivec acc, ivec w, ivec x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#endif
INLINE fvec fcvt(ivec a) { return _mm512_cvtepi32_ps(a); }
INLINE fvec fzero(void) { return _mm512_setzero_ps(); }
INLINE fvec fset1(float v) { return _mm512_set1_ps(v); }
INLINE fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE fvec ffnma(fvec a, fvec b, fvec c) { return _mm512_fnmadd_ps(a, b, c); }
INLINE fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
INLINE fvec fsub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
INLINE fvec fload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE void fstore(float *p, fvec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA 256
#define LANES 8
#define HALVES 2
#define TILE 2
typedef __m256i ivec;
typedef __m256 fvec;
INLINE ivec iload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE ivec iset16(short v) { return _mm256_set1_epi16(v); }
INLINE ivec iand(ivec a, ivec b) { return _mm256_and_si256(a, b); }
INLINE ivec isrl16(ivec a, int count) { return _mm256_srli_epi16(a, count); }
INLINE ivec izero(void) { return _mm256_setzero_si256(); }
INLINE ivec ipair(const int16_t *x) { int32_t v; memcpy(&v, x, 4); return _mm256_set1_epi32(v); }
INLINE ivec idot(ivec acc, ivec w, ivec x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
INLINE fvec fcvt(ivec a) { return _mm256_cvtepi32_ps(a); }
INLINE fvec fzero(void) { return _mm256_setzero_ps(); }
INLINE fvec fset1(float v) { return _mm256_set1_ps(v); }
INLINE fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE fvec ffnma(fvec a, fvec b, fvec c) { return _mm256_fnmadd_ps(a, b, c); }
INLINE fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
INLINE fvec fsub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
INLINE fvec fload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE void fstore(float *p, fvec v) { _mm256_storeu_ps(p, v); }
#else
#define ISA 0
#endif

int quant_kernel_isa(void) { return ISA; }

#if ISA

#define VBYTES (CHUNK / HALVES) /* bytes of one vector: rows [h * LANES, (h + 1) * LANES) of a chunk */

/* Rows [first, first + LANES) of y[r] from the float accumulator, bias added, rounded to bf16; rows past
 * n (the padded block) are not written. */
INLINE void store_rows(uint16_t *y_row, const uint16_t *bias, int64_t first, int64_t n, fvec value) {
    float values[LANES];
    fstore(values, value);
    const int64_t count = n - first < LANES ? n - first : LANES;
    for (int64_t l = 0; l < count; l++)
        y_row[first + l] = f32_to_bf16(values[l] + (bias != NULL ? bf16_to_f32(bias[first + l]) : 0.0f));
}

/* T row blocks (from `block`) against MR x rows (from r0): the whole k for each. */
INLINE void gemv_tile(const int BITS, const int T, const int MR, const uint8_t *codes, const uint16_t *scales,
                      const uint16_t *zeros, const Prepared *p, const uint16_t *bias, uint16_t *y, int64_t block,
                      int64_t r0, int64_t n, int64_t k, int64_t group) {
    const int64_t step = BITS == 8 ? 4 : 8, chunks = k / step, groups = k / group;
    const int64_t chunks_per_x_block = p->x_block / step;
    const ivec low8 = iset16(0x00ff), low4 = iset16(0x000f);
    const fvec midpoint = fset1(BITS == 8 ? 128.0f : 8.0f);
    fvec acc[T][MR][HALVES];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < HALVES; h++) acc[t][r][h] = fzero();
    for (int64_t xb = 0; xb < p->x_blocks; xb++) {
        ivec dot[T][MR][HALVES];
        for (int t = 0; t < T; t++)
            for (int r = 0; r < MR; r++)
                for (int h = 0; h < HALVES; h++) dot[t][r][h] = izero();
        for (int64_t c = xb * chunks_per_x_block; c < (xb + 1) * chunks_per_x_block; c++) {
            const int16_t *xs = p->xq + r0 * k + c * step;
            for (int t = 0; t < T; t++) /* prefetching never faults, so past a block's end is harmless */
                _mm_prefetch((const char *)(codes + ((block + t) * chunks + c + PREFETCH_CHUNKS) * CHUNK), _MM_HINT_T0);
            for (int t = 0; t < T; t++)
                for (int h = 0; h < HALVES; h++) {
                    const ivec words = iload(codes + ((block + t) * chunks + c) * CHUNK + h * VBYTES);
                    if (BITS == 8) {
                        const ivec lo = iand(words, low8), hi = isrl16(words, 8);
                        for (int r = 0; r < MR; r++) {
                            dot[t][r][h] = idot(dot[t][r][h], lo, ipair(xs + r * k));
                            dot[t][r][h] = idot(dot[t][r][h], hi, ipair(xs + r * k + 2));
                        }
                    } else {
                        const ivec n0 = iand(words, low4), n1 = iand(isrl16(words, 4), low4);
                        const ivec n2 = iand(isrl16(words, 8), low4), n3 = isrl16(words, 12);
                        for (int r = 0; r < MR; r++) {
                            dot[t][r][h] = idot(dot[t][r][h], n0, ipair(xs + r * k));
                            dot[t][r][h] = idot(dot[t][r][h], n1, ipair(xs + r * k + 2));
                            dot[t][r][h] = idot(dot[t][r][h], n2, ipair(xs + r * k + 4));
                            dot[t][r][h] = idot(dot[t][r][h], n3, ipair(xs + r * k + 6));
                        }
                    }
                }
        }
        const int64_t g = xb * p->x_block / group;
        for (int t = 0; t < T; t++)
            for (int h = 0; h < HALVES; h++) {
                const int64_t at = ((block + t) * groups + g) * BLOCK + h * LANES;
                const fvec scale = fload_f16(scales + at), zero = zeros != NULL ? fload_f16(zeros + at) : midpoint;
                for (int r = 0; r < MR; r++) {
                    const int64_t row = (r0 + r) * p->x_blocks + xb;
                    const fvec exact = ffnma(zero, fset1(p->xsum[row]), fcvt(dot[t][r][h]));
                    acc[t][r][h] = ffma(exact, fmul(scale, fset1(p->xscale[row])), acc[t][r][h]);
                }
            }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < MR; r++)
            for (int h = 0; h < HALVES; h++)
                store_rows(y + (r0 + r) * n, bias, (block + t) * BLOCK + h * LANES, n, acc[t][r][h]);
}

/* x rows per pass: 4, 2 or 1 (the largest that fits the remaining rows) */
INLINE int x_rows(int64_t remaining) { return remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1; }

#define TILE_CALL(BITS, T, MR) gemv_tile(BITS, T, MR, codes, scales, zeros, p, bias, y, b, r0, n, k, group)
#define WIDTHS(BITS, MR)                                                   \
    do {                                                                   \
        if (T == 8) TILE_CALL(BITS, 8, MR);                                \
        else if (T == 4) TILE_CALL(BITS, 4, MR);                           \
        else if (T == 2) TILE_CALL(BITS, 2, MR);                           \
        else TILE_CALL(BITS, 1, MR);                                       \
    } while (0)

/* Blocks [block, block + width) against x rows [r0, r0 + MR), in tiles of constant shape (so their loops
 * unroll and the accumulators stay in registers): up to TILE / MR blocks a tile, then halves for the rest. */
static void run_rows(int bits, int MR, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                     const Prepared *p, const uint16_t *bias, uint16_t *y, int64_t block, int64_t width, int64_t r0,
                     int64_t n, int64_t k, int64_t group) {
    for (int64_t b = block; b < block + width;) {
        int64_t T = TILE / MR > 8 ? 8 : TILE / MR;
        if (T < 1) T = 1;
        while (T > block + width - b) T /= 2;
        if (bits == 8) {
            if (MR == 1) WIDTHS(8, 1); else if (MR == 2) WIDTHS(8, 2); else WIDTHS(8, 4);
        } else {
            if (MR == 1) WIDTHS(4, 1); else if (MR == 2) WIDTHS(4, 2); else WIDTHS(4, 4);
        }
        b += T;
    }
}

/* Returns 0 (nothing computed) for shapes the layout does not cover; the caller checks them first. */
int quant_gemv_bf16(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x,
                    const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !covered(bits, n, k, group)) return 0;
    Prepared prepared, *p = &prepared;
    if (!prepare((const uint16_t *)x, m, k, x_block_of(group, bits), p)) return 0;
    const uint8_t *codes = (const uint8_t *)weight;
    const uint16_t *scales = (const uint16_t *)scales_, *zeros = (const uint16_t *)zeros_;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *y = (uint16_t *)y_;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > blocks ? blocks : num_threads);
#pragma omp parallel num_threads(threads)
    {
        const int64_t me = omp_get_thread_num();
        const int64_t first = blocks * me / threads, last = blocks * (me + 1) / threads;
        /* TILE blocks at a time for all the x rows: the tile's codes are re-read from L1/L2 for later rows */
        for (int64_t block = first; block < last; block += TILE) {
            const int64_t width = last - block < TILE ? last - block : TILE;
            for (int64_t r0 = 0; r0 < m;) {
                const int MR = x_rows(m - r0);
                run_rows(bits, MR, codes, scales, zeros, p, bias, y, block, width, r0, n, k, group);
                r0 += MR;
            }
        }
    }
    free(p->xq), free(p->xscale), free(p->xsum);
    return 1;
}

/* One code of the layout: row i (of its block) at input j of chunk `chunk` (a chunk's 64 bytes). */
INLINE uint32_t layout_code(const uint8_t *chunk, int64_t i, int64_t j, int bits) {
    const uint8_t *lane = chunk + 4 * i; /* words 2i (e = 0) and 2i + 1 (e = 1) */
    const uint32_t word = (uint32_t)lane[2 * (j & 1)] | (uint32_t)lane[2 * (j & 1) + 1] << 8;
    return (word >> (bits * (j >> 1))) & ((1u << bits) - 1);
}

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
    const float midpoint = bits == 8 ? 128.0f : 8.0f;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *columns = (float *)malloc(sizeof(float) * (size_t)(k * BLOCK)); /* [k, 16] */
        failed |= columns == NULL;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            if (columns == NULL) continue;
            const int64_t rows = n - block * BLOCK < BLOCK ? n - block * BLOCK : BLOCK;
            const uint8_t *base = codes + block * chunks * CHUNK;
#if ISA == 512
            const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = (block * groups + g) * BLOCK;
                const __m512 scale = fload_f16(scales + at);
                const __m512 zero = zeros != NULL ? fload_f16(zeros + at) : fset1(midpoint);
                for (int64_t c = g * group / step; c < (g + 1) * group / step; c++) {
                    const __m512i lanes = _mm512_loadu_si512((const void *)(base + c * CHUNK)); /* lane i: words 2i, 2i+1 */
                    for (int j = 0; j < step; j++) {
                        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(lanes, 16 * (j & 1) + bits * (j >> 1)), mask);
                        _mm512_storeu_ps(columns + (c * step + j) * BLOCK,
                                         _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), zero), scale));
                    }
                }
            }
            const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                      _mm512_set1_epi32(BLOCK));
            for (int64_t i = 0; i < rows; i++) {
                uint16_t *dst = (uint16_t *)out + (block * BLOCK + i) * k;
                int64_t j = 0;
                for (; j + 16 <= k; j += 16)
                    _mm256_storeu_si256((__m256i *)(dst + j),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_i32gather_ps(stride, columns + j * BLOCK + i, 4)));
                for (; j < k; j++) dst[j] = f32_to_bf16(columns[j * BLOCK + i]);
            }
#else
            for (int64_t g = 0; g < groups; g++)
                for (int64_t i = 0; i < rows; i++) {
                    const int64_t at = (block * groups + g) * BLOCK + i;
                    const float scale = _cvtsh_ss(scales[at]), zero = zeros != NULL ? _cvtsh_ss(zeros[at]) : midpoint;
                    for (int64_t c = g * group / step; c < (g + 1) * group / step; c++)
                        for (int64_t j = 0; j < step; j++)
                            columns[(c * step + j) * BLOCK + i] = ((float)layout_code(base + c * CHUNK, i, j, bits) - zero) * scale;
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
int quant_gemv_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0;
}
int quant_dequantize_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                          int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)out, (void)n, (void)k, (void)group, (void)num_threads;
    return 0;
}
#endif
