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
 *   4 bits (STEP 8):  nibble t (from the lowest) = input 8c + 2t + e;
 *   6 bits (STEP 4):  the 8-bit chunk stored in 48 bytes (SIX_CHUNK below), rebuilt in registers;
 *   IQ4_CODES (STEP 4): 8-bit codes from IQ4_NL's 16-value grid, the 8-bit chunk stored as 4-bit grid indices in
 *                     32 bytes (GRID_CHUNK below), rebuilt in registers.
 * codes uint8 [blocks, k / STEP, 64 (6 bits: 48; IQ4_CODES: 32)]; scales and zeros float16 [blocks, groups, 16] (zeros may be NULL: the
 * midpoint 2^(bits-1)). A masked shift turns a chunk into words whose lane i pair (e = 0, 1) is row i's
 * codes of two neighbouring inputs, so one int16 pair dot product (vpdpwssd: 16 rows x 2 inputs) takes
 * x[2j], x[2j+1] broadcast as one 32-bit word.
 *
 * Activations: converted once per call to int16 per x block (B inputs inside one weight group, B <= 256),
 * xq = round(x * 32767 / max|x_block|): an element's error is at most 2^-16 of its block's largest, far
 * below bf16's own 2^-9 of each element. Per block and 16 rows the int32 dot products D = sum xq * q then
 * give  scale * xscale * (D - zero * sum xq)  (exact integers up to the float conversion).
 * Threads split the 16-row blocks; each thread streams its blocks once for all the x rows (x rows taken
 * MR at a time, re-reading a tile of blocks from L1/L2 for the next rows). One x row (batch-1 decode) on the
 * AVX-512 body reads its blocks one after another instead (`stream_block`; 4-bit codes with VNNI:
 * `stream_block_bytes`). The AVX-512 body takes 8 x rows at a
 * time where it can (`wide_tile`: 16 int32 accumulators, near vpdpwssd's peak), the same arithmetic per output.
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
/* Each stream of a tile prefetched this many chunks ahead: cold 3072x576, one thread, one x row when tiles ran
 * it (now stream_block does), 4-bit g32 116 -> 98-103 µs, 8-bit 142 -> 128-134 µs; 4 and 32 chunks did worse. */
#define PREFETCH_CHUNKS 8
#define WIDE_MR 8 /* x rows of the AVX-512 body's wide tiles */

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

INLINE int64_t step_of(int bits) { return bits == 4 ? 8 : 4; }

/* 6-bit codes (GGUF's 5- and 6-bit types) keep the 8-bit layout, each 64-byte chunk stored in SIX_CHUNK bytes: 32
 * bytes of the chunk's bytes' low nibbles (byte t: chunk bytes 2t and 2t + 1 in its low and high nibble), then
 * 16 of their high 2 bits (byte i: row i's four bytes 4i + j at bits 2j); `six_words` rebuilds the 8-bit chunk in
 * registers, so every path runs its 8-bit arithmetic on 0.75 bytes a code instead of 1. */
#define SIX_CHUNK 48
/* GGUF's IQ4_NL and IQ4_XS weights are 4-bit indices into ggml's non-linear grid kvalues_iq4nl; as 8-bit codes
 * (grid + 128, the midpoint 128) they ran the 8-bit layout at 1 byte a weight. IQ4_CODES keeps the 8-bit layout's
 * chunks as the grid indices of their bytes, two a byte as SIX_CHUNK's first 32 bytes hold nibbles, and
 * `grid_words` looks the codes up in registers (vpshufb): 0.5 bytes a code, 8-bit arithmetic. The value says what it
 * is: stored in 4 bits (0x40), computed in 8 (0x08). */
#define IQ4_CODES 0x48
#define GRID_CHUNK 32
static const uint8_t IQ4_GRID[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
INLINE int64_t chunk_bytes(int bits) { return bits == 6 ? SIX_CHUNK : bits == IQ4_CODES ? GRID_CHUNK : CHUNK; }
INLINE int code_bits(int bits) { return bits == IQ4_CODES ? 8 : bits; } /* the width the arithmetic sees */
INLINE float midpoint_of(int bits) { return (float)(1 << (code_bits(bits) - 1)); }
INLINE int known_bits(int bits) { return bits == 4 || bits == 6 || bits == 8 || bits == IQ4_CODES; }
INLINE int amx_bits(int bits) { return bits == 4 || bits == 8; } /* the AMX kernels' code widths */

/* Inputs per x block: the group itself up to X_BLOCK_MAX, else its largest divisor that fits and is whole
 * chunks (0: none). */
static int64_t x_block_of(int64_t group, int bits) {
    const int64_t step = step_of(bits);
    if (group <= X_BLOCK_MAX) return group;
    for (int64_t size = X_BLOCK_MAX; size >= step; size -= step)
        if (group % size == 0 && size % step == 0) return size;
    return 0;
}

/* x_block_of for the Python side (QuantKernels.int8_tile_depth), so the rule lives here only. */
int64_t quant_x_block_of(int64_t group, int bits) { return known_bits(bits) ? x_block_of(group, bits) : 0; }

/* Whether the layout covers this shape (the Python side checks first and explains). */
static int covered(int bits, int64_t n, int64_t k, int64_t group) {
    if (!known_bits(bits) || n < 1 || group < 1 || k < 1 || k % group) return 0;
    return group % step_of(bits) == 0 && x_block_of(group, bits) > 0;
}

/* Per call: x as int16 per x block, with each block's scale and code sum. */
typedef struct {
    int16_t *xq;     /* [m, k] */
    float *xscale;   /* [m, x_blocks] */
    float *xsum;     /* [m, x_blocks] (exact integers) */
    int64_t x_block, x_blocks;
} Prepared;

/* One x block of `size` inputs: its int16 codes, scale and code sum. */
static void prepare_block(const uint16_t *src, int16_t *dst, int64_t size, float *xscale, float *xsum) {
    float top = 0.0f;
    for (int64_t i = 0; i < size; i++) top = fmaxf(top, fabsf(bf16_to_f32(src[i])));
    const float inverse = top > 0.0f && top <= 3.0e38f ? 32767.0f / top : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < size; i++) {
        const int32_t q = (int32_t)lrintf(bf16_to_f32(src[i]) * inverse);
        dst[i] = (int16_t)q, sum += q;
    }
    *xscale = inverse > 0.0f ? top / 32767.0f : 0.0f;
    *xsum = (float)sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* The largest magnitude of a block (size a multiple of 16); 0 where it holds a NaN or a magnitude above 3e38
 * (the scalar rules for NaN and infinities decide those). */
INLINE int block_largest(const uint16_t *src, int64_t size, float *largest) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 unusual = 0;
    for (int64_t i = 0; i < size; i += 16) {
        const __m512 v = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16));
        const __m512 magnitude = _mm512_abs_ps(v);
        unusual |= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(3.0e38f), _CMP_NLE_UQ);
        top = _mm512_max_ps(top, magnitude);
    }
    *largest = _mm512_reduce_max_ps(top);
    return !unusual;
}

/* prepare_block 16 inputs a vector (size a multiple of 16), bitwise its result: the largest magnitude is
 * exact in any order and vcvtps2dq rounds to nearest even as lrintf does. A block holding a NaN or a
 * magnitude above 3e38 (where the scalar rules for NaN and infinities decide) goes to prepare_block. The
 * scalar loops were most of a small GEMV's fixed cost (one thread, thread CPU time, hot 16x576 4-bit: 7.3 ->
 * 4.3 us a call, 16x1536: 14.2 -> 5.6 us; a SmolLM-135M token's 121 int4-g32 GEMVs, cold: 11.4 -> 11.2 ms). */
static void prepare_block_512(const uint16_t *src, int16_t *dst, int64_t size, float *xscale, float *xsum) {
    float largest;
    if (!block_largest(src, size, &largest)) {
        prepare_block(src, dst, size, xscale, xsum);
        return;
    }
    const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < size; i += 16) {
        const __m512 v = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i))), 16));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, scale));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(q));
        sum = _mm512_add_epi32(sum, q);
    }
    *xscale = inverse > 0.0f ? largest / 32767.0f : 0.0f;
    *xsum = (float)_mm512_reduce_add_epi32(sum);
}
#endif

static int prepare_alloc(int64_t m, int64_t k, int64_t x_block, Prepared *p) {
    p->x_block = x_block, p->x_blocks = k / x_block;
    p->xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k));
    p->xscale = (float *)malloc(sizeof(float) * (size_t)(m * p->x_blocks));
    p->xsum = (float *)malloc(sizeof(float) * (size_t)(m * p->x_blocks));
    if (p->xq == NULL || p->xscale == NULL || p->xsum == NULL) {
        free(p->xq), free(p->xscale), free(p->xsum);
        return 0;
    }
    return 1;
}

/* x rows [first, last) as int16 blocks */
static void prepare_rows(const uint16_t *x, int64_t first, int64_t last, int64_t k, const Prepared *p) {
    const int64_t x_block = p->x_block;
    for (int64_t r = first; r < last; r++)
        for (int64_t b = 0; b < p->x_blocks; b++) {
            const uint16_t *src = x + r * k + b * x_block;
            int16_t *dst = p->xq + r * k + b * x_block;
            float *xscale = p->xscale + r * p->x_blocks + b, *xsum = p->xsum + r * p->x_blocks + b;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (x_block % 16 == 0) {
                prepare_block_512(src, dst, x_block, xscale, xsum);
                continue;
            }
#endif
            prepare_block(src, dst, x_block, xscale, xsum);
        }
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
/* A 6-bit chunk (SIX_CHUNK bytes at `chunk`) as its 64-byte 8-bit chunk: the nibbles widened to bytes, each row's
 * high-bits byte spread to bits 4-5 of its four bytes (one multishift with VBMI: output byte j of a row's lane
 * takes bits 2j - 4 on, rotated, of the lane's 64-bit pair). */
INLINE __m512i six_words(const uint8_t *chunk, int half) {
    (void)half;
    const __m512i nibbles = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)chunk));
    const __m512i low = _mm512_and_si512(_mm512_or_si512(nibbles, _mm512_slli_epi16(nibbles, 4)),
                                         _mm512_set1_epi16(0x0f0f));
    const __m512i high = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(chunk + 32)));
#if defined(__AVX512VBMI__)
    const __m512i spread = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x22201e1c02003e3cLL), high);
#else /* byte j of a lane: its bits 0-1 are high's bits 2j, 2j + 1 (the other fields land elsewhere), moved to 4-5 */
    const __m512i spread = _mm512_slli_epi32(_mm512_or_si512(_mm512_or_si512(high, _mm512_slli_epi32(high, 6)),
                                                             _mm512_or_si512(_mm512_slli_epi32(high, 12),
                                                                             _mm512_slli_epi32(high, 18))), 4);
#endif
    return _mm512_ternarylogic_epi32(low, spread, _mm512_set1_epi8(0x30), 0xf8); /* low | (spread & 0x30) */
}
/* An IQ4_CODES chunk (GRID_CHUNK bytes) as its 64-byte 8-bit chunk: nibble i (the chunk's 32 bytes read from the
 * lowest) indexes the grid for byte i. With VBMI each 32 bits of nibbles widen to a 64-bit lane, one multishift puts
 * nibble 8d + j at the bottom of the lane's byte j, and vpermb looks it up in the grid repeated four times (it reads
 * 6 index bits: the next nibble's low 2 bits above it pick a copy); else six_words' nibble spread and a vpshufb. */
INLINE __m512i grid_words(const uint8_t *chunk, int half) {
    (void)half;
#if defined(__AVX512VBMI__)
    const __m512i lanes = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)chunk));
    const __m512i indices = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x1c1814100c080400LL), lanes);
    return _mm512_permutexvar_epi8(indices, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_GRID)));
#else
    const __m512i nibbles = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)chunk));
    const __m512i indices = _mm512_and_si512(_mm512_or_si512(nibbles, _mm512_slli_epi16(nibbles, 4)),
                                             _mm512_set1_epi16(0x0f0f));
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_GRID)), indices);
#endif
}
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
/* The AVX-512 body's six_words for one half of the chunk (rows 8 half .. 8 half + 7: its nibble bytes 16 half on,
 * its high-bits bytes 8 half on). */
INLINE __m256i six_words(const uint8_t *chunk, int half) {
    const __m256i nibbles = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(chunk + 16 * half)));
    const __m256i low = _mm256_and_si256(_mm256_or_si256(nibbles, _mm256_slli_epi16(nibbles, 4)),
                                         _mm256_set1_epi16(0x0f0f));
    const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(chunk + 32 + 8 * half)));
    const __m256i spread = _mm256_or_si256(_mm256_or_si256(high, _mm256_slli_epi32(high, 6)),
                                           _mm256_or_si256(_mm256_slli_epi32(high, 12), _mm256_slli_epi32(high, 18)));
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi32(spread, 4), _mm256_set1_epi8(0x30)));
}
/* The AVX-512 body's grid_words for one half of the chunk (its index bytes 16 half on). */
INLINE __m256i grid_words(const uint8_t *chunk, int half) {
    const __m256i nibbles = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(chunk + 16 * half)));
    const __m256i indices = _mm256_and_si256(_mm256_or_si256(nibbles, _mm256_slli_epi16(nibbles, 4)),
                                             _mm256_set1_epi16(0x0f0f));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_GRID)), indices);
}
#else
#define ISA 0
#endif

int quant_kernel_isa(void) { return ISA; }

#if ISA

#define VBYTES (CHUNK / HALVES) /* bytes of one vector: rows [h * LANES, (h + 1) * LANES) of a chunk */

/* Vector `half` of the chunk at `chunk` as 8-bit (or 4-bit) layout words. */
INLINE ivec load_words(const int BITS, const uint8_t *chunk, int half) {
    if (BITS == 6) return six_words(chunk, half);
    return BITS == IQ4_CODES ? grid_words(chunk, half) : iload(chunk + half * VBYTES);
}

#if ISA == 512
/* f32_to_bf16 on 16 lanes, bitwise (nearest even; NaN quiet; subnormals kept, which vcvtneps2bf16 flushes) */
INLINE __m256i round_bf16_exact(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
#endif

/* Rows [first, first + LANES) of y[r] from the float accumulator, bias added, rounded to bf16; rows past
 * n (the padded block) are not written. On AVX-512 in vectors, the same bits (the bias, or 0, added in float32, then
 * f32_to_bf16's rounding): the scalar loop took ~10 % of the bf16 GEMM's time (a tile of 8 rows x 32 outputs: 256
 * conversions against 16 x 288 dot-product steps at 576 inputs; 3072x576 at 2048 rows 1.06 -> 0.98-1.00x oneDNN's). */
INLINE void store_rows(uint16_t *y_row, const uint16_t *bias, int64_t first, int64_t n, fvec value) {
#if ISA == 512
    const __mmask16 live = n - first >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (n - first)) - 1);
    const __m512 add = bias == NULL ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + first)), 16));
    _mm256_mask_storeu_epi16(y_row + first, live, round_bf16_exact(_mm512_add_ps(value, add)));
#else
    float values[LANES];
    fstore(values, value);
    const int64_t count = n - first < LANES ? n - first : LANES;
    for (int64_t l = 0; l < count; l++)
        y_row[first + l] = f32_to_bf16(values[l] + (bias != NULL ? bf16_to_f32(bias[first + l]) : 0.0f));
#endif
}

/* T row blocks (from `block`) against MR x rows (from r0): the whole k for each. */
INLINE void gemv_tile(const int BITS, const int T, const int MR, const uint8_t *codes, const uint16_t *scales,
                      const uint16_t *zeros, const Prepared *p, const uint16_t *bias, uint16_t *y, int64_t block,
                      int64_t r0, int64_t n, int64_t k, int64_t group) {
    const int64_t step = step_of(BITS), chunks = k / step, groups = k / group, bytes = chunk_bytes(BITS);
    const int64_t chunks_per_x_block = p->x_block / step;
    const ivec low8 = iset16(0x00ff), low4 = iset16(0x000f);
    const fvec midpoint = fset1(midpoint_of(BITS));
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
                _mm_prefetch((const char *)(codes + ((block + t) * chunks + c + PREFETCH_CHUNKS) * bytes), _MM_HINT_T0);
            for (int t = 0; t < T; t++)
                for (int h = 0; h < HALVES; h++) {
                    const ivec words = load_words(BITS, codes + ((block + t) * chunks + c) * bytes, h);
                    if (BITS != 4) {
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

#if ISA == 512
#define WIDE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) /* WIDE_MR of them */

/* gemv_tile for many rows: two blocks (b0, b1; b1 may repeat b0, then only b0 is stored) x WIDE_MR rows, whole
 * k: 16 int32 accumulators in named registers (an array of them the compiler stored back every chunk), x rows
 * packed per chunk (xw: [chunk][WIDE_MR][step]), the float accumulators in memory, updated once per x block in
 * gemv_tile's order, so every output is bitwise gemv_tile's. */
INLINE void wide_tile(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                      const Prepared *p, const int16_t *xw, const uint16_t *bias, uint16_t *y, int64_t b0, int64_t b1,
                      int64_t r0, int64_t n, int64_t k, int64_t group) {
    const int step = (int)step_of(BITS);
    const int64_t chunks = k / step, groups = k / group, chunks_per_x_block = p->x_block / step, bytes = chunk_bytes(BITS);
    const ivec low8 = iset16(0x00ff), low4 = iset16(0x000f);
    const fvec midpoint = fset1(midpoint_of(BITS));
    const uint8_t *codes0 = codes + b0 * chunks * bytes, *codes1 = codes + b1 * chunks * bytes;
    float acc[2][WIDE_MR][LANES] __attribute__((aligned(64)));
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < WIDE_MR; r++) fstore(acc[t][r], fzero());
    for (int64_t xb = 0; xb < p->x_blocks; xb++) {
#define WIDE_ZERO(r) ivec d0_##r = izero(), d1_##r = izero();
        WIDE_ROWS(WIDE_ZERO)
#define WIDE_DOT(r, w0, w1, at) { const ivec xr = ipair(xs + r * step + at); \
                                  d0_##r = idot(d0_##r, w0, xr); d1_##r = idot(d1_##r, w1, xr); }
#define WIDE_LO(r) WIDE_DOT(r, lo0, lo1, 0)
#define WIDE_HI(r) WIDE_DOT(r, hi0, hi1, 2)
#define WIDE_N0(r) WIDE_DOT(r, n0, m0, 0)
#define WIDE_N1(r) WIDE_DOT(r, n1, m1, 2)
#define WIDE_N2(r) WIDE_DOT(r, n2, m2, 4)
#define WIDE_N3(r) WIDE_DOT(r, n3, m3, 6)
        for (int64_t c = xb * chunks_per_x_block; c < (xb + 1) * chunks_per_x_block; c++) {
            const int16_t *xs = xw + c * WIDE_MR * step;
            _mm_prefetch((const char *)(codes0 + (c + PREFETCH_CHUNKS) * bytes), _MM_HINT_T0);
            _mm_prefetch((const char *)(codes1 + (c + PREFETCH_CHUNKS) * bytes), _MM_HINT_T0);
            const ivec words0 = load_words(BITS, codes0 + c * bytes, 0), words1 = load_words(BITS, codes1 + c * bytes, 0);
            if (BITS != 4) {
                const ivec lo0 = iand(words0, low8), lo1 = iand(words1, low8);
                WIDE_ROWS(WIDE_LO)
                const ivec hi0 = isrl16(words0, 8), hi1 = isrl16(words1, 8);
                WIDE_ROWS(WIDE_HI)
            } else {
                const ivec n0 = iand(words0, low4), m0 = iand(words1, low4);
                WIDE_ROWS(WIDE_N0)
                const ivec n1 = iand(isrl16(words0, 4), low4), m1 = iand(isrl16(words1, 4), low4);
                WIDE_ROWS(WIDE_N1)
                const ivec n2 = iand(isrl16(words0, 8), low4), m2 = iand(isrl16(words1, 8), low4);
                WIDE_ROWS(WIDE_N2)
                const ivec n3 = isrl16(words0, 12), m3 = isrl16(words1, 12);
                WIDE_ROWS(WIDE_N3)
            }
        }
        const int64_t g = xb * p->x_block / group;
        const int64_t at0 = (b0 * groups + g) * BLOCK, at1 = (b1 * groups + g) * BLOCK;
        const fvec scale0 = fload_f16(scales + at0), zero0 = zeros != NULL ? fload_f16(zeros + at0) : midpoint;
        const fvec scale1 = fload_f16(scales + at1), zero1 = zeros != NULL ? fload_f16(zeros + at1) : midpoint;
#define WIDE_UPDATE(r)                                                                                         \
        {                                                                                                      \
            const float xsum = p->xsum[(r0 + r) * p->x_blocks + xb], xscale = p->xscale[(r0 + r) * p->x_blocks + xb]; \
            fstore(acc[0][r], ffma(ffnma(zero0, fset1(xsum), fcvt(d0_##r)), fmul(scale0, fset1(xscale)),        \
                                   _mm512_load_ps(acc[0][r])));                                                 \
            fstore(acc[1][r], ffma(ffnma(zero1, fset1(xsum), fcvt(d1_##r)), fmul(scale1, fset1(xscale)),        \
                                   _mm512_load_ps(acc[1][r])));                                                 \
        }
        WIDE_ROWS(WIDE_UPDATE)
    }
    for (int r = 0; r < WIDE_MR; r++) {
        store_rows(y + (r0 + r) * n, bias, b0 * BLOCK, n, _mm512_load_ps(acc[0][r]));
        if (b1 != b0) store_rows(y + (r0 + r) * n, bias, b1 * BLOCK, n, _mm512_load_ps(acc[1][r]));
    }
}

/* Blocks [block, block + width) against x rows [r0, r0 + WIDE_MR), two blocks a tile. */
static void run_wide(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                     const Prepared *p, const int16_t *xw, const uint16_t *bias, uint16_t *y, int64_t block,
                     int64_t width, int64_t r0, int64_t n, int64_t k, int64_t group) {
    for (int64_t b = block; b < block + width; b += 2) {
        const int64_t b1 = b + 1 < block + width ? b + 1 : b;
        if (bits == 8) wide_tile(8, codes, scales, zeros, p, xw, bias, y, b, b1, r0, n, k, group);
        else if (bits == 6) wide_tile(6, codes, scales, zeros, p, xw, bias, y, b, b1, r0, n, k, group);
        else if (bits == IQ4_CODES) wide_tile(IQ4_CODES, codes, scales, zeros, p, xw, bias, y, b, b1, r0, n, k, group);
        else wide_tile(4, codes, scales, zeros, p, xw, bias, y, b, b1, r0, n, k, group);
    }
}
#endif

#if ISA == 512
/* One block's 16 rows of x block xb added to acc: the exact int32 dot products `dot` to float, the zero point's
 * share taken off, times the weight's and x's scales (gemv_tile's arithmetic, one row); `at`: where the block's
 * group's scales (and zeros; NULL: the midpoint) start. */
INLINE fvec add_x_block(fvec acc, ivec dot, const uint16_t *scales, const uint16_t *zeros, fvec midpoint,
                        const Prepared *p, int64_t at, int64_t xb) {
    const fvec scale = fload_f16(scales + at), zero = zeros != NULL ? fload_f16(zeros + at) : midpoint;
    const fvec exact = ffnma(zero, fset1(p->xsum[xb]), fcvt(dot));
    return ffma(exact, fmul(scale, fset1(p->xscale[xb])), acc);
}

/* gemv_tile for one x row and one block: a thread reads its blocks' codes in order, one stream, where a tile
 * of eight blocks read eight interleaved ones (each block's run a few KiB), prefetched STREAM_AHEAD bytes
 * ahead. Eight int32 chains (the chunk's parity x its four nibble planes, or its two byte planes) hide the
 * dot products' latency; they are added at the x block's end, exact integers, so every output is bitwise
 * gemv_tile's. A SmolLM-135M token's 121 GEMVs (Zen 5, cold, alternated in one process), two threads:
 * int4-g32 1.91 -> 1.38 ms, int8 3.47 -> 2.72 ms; one thread 3.17 -> 2.13 and 4.42 -> 3.37 ms. STREAM_AHEAD:
 * 6 KiB, where 4 KiB fell behind when the host's memory was fast (the same GEMVs, two threads, alternated pass
 * by pass with a 256 MiB read: at a read figure of 60-80 GB/s, int8 51.1 -> 55.9 GB/s and int4-g32 37.2 ->
 * 40.8 GB/s over 145 and 312 passes; at 36-45 GB/s even; 8, 12 and 16 KiB between the two). */
#define STREAM_AHEAD 6144
INLINE void stream_block(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                         const Prepared *p, const uint16_t *bias, uint16_t *y, int64_t block, int64_t n, int64_t k,
                         int64_t group, const uint8_t *stream_end) {
    const int64_t step = step_of(BITS), chunks = k / step, groups = k / group, bytes = chunk_bytes(BITS);
    const int64_t chunks_per_x_block = p->x_block / step;
    const ivec low8 = iset16(0x00ff), low4 = iset16(0x000f);
    const fvec midpoint = fset1(midpoint_of(BITS));
    const uint8_t *base = codes + block * chunks * bytes;
    fvec acc = fzero();
    for (int64_t xb = 0; xb < p->x_blocks; xb++) {
        ivec d0 = izero(), d1 = izero(), d2 = izero(), d3 = izero(), d4 = izero(), d5 = izero(), d6 = izero(), d7 = izero();
        const int64_t end = (xb + 1) * chunks_per_x_block;
#define STREAM_CHUNK(c, a0, a1, a2, a3)                                                                       \
        {                                                                                                     \
            const int16_t *xs = p->xq + (c) * step;                                                           \
            if (base + (c) * bytes + STREAM_AHEAD < stream_end)                                               \
                _mm_prefetch((const char *)(base + (c) * bytes + STREAM_AHEAD), _MM_HINT_NTA);                \
            const ivec words = load_words(BITS, base + (c) * bytes, 0);                                       \
            if (BITS != 4) {                                                                                  \
                a0 = idot(a0, iand(words, low8), ipair(xs));                                                  \
                a1 = idot(a1, isrl16(words, 8), ipair(xs + 2));                                               \
            } else {                                                                                          \
                a0 = idot(a0, iand(words, low4), ipair(xs));                                                  \
                a1 = idot(a1, iand(isrl16(words, 4), low4), ipair(xs + 2));                                   \
                a2 = idot(a2, iand(isrl16(words, 8), low4), ipair(xs + 4));                                   \
                a3 = idot(a3, isrl16(words, 12), ipair(xs + 6));                                              \
            }                                                                                                 \
        }
        int64_t c = xb * chunks_per_x_block;
        for (; c + 2 <= end; c += 2) {
            STREAM_CHUNK(c, d0, d1, d2, d3)
            STREAM_CHUNK(c + 1, d4, d5, d6, d7)
        }
        if (c < end) STREAM_CHUNK(c, d0, d1, d2, d3)
#undef STREAM_CHUNK
        const ivec dot = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_add_epi32(d2, d3)),
                                          _mm512_add_epi32(_mm512_add_epi32(d4, d5), _mm512_add_epi32(d6, d7)));
        acc = add_x_block(acc, dot, scales, zeros, midpoint, p, (block * groups + xb * p->x_block / group) * BLOCK, xb);
    }
    store_rows(y, bias, block * BLOCK, n, acc);
}
#endif

#if ISA == 512 && defined(__AVX512VNNI__)
#define BYTE_PLANES 1
/* stream_block_bytes prefetches BYTES_AHEAD ahead, stream_block STREAM_AHEAD, both as non-temporal (prefetchnta):
 * a token reads each weight once, and lines fetched for the cache levels (two steps, into L2 12 KiB ahead and into
 * L1 2 KiB ahead, as before) reach L3 when L2 evicts them (Zen's L3 takes L2's victims), so the 75 MB a
 * SmolLM-135M int4-g32 token streams through the 32 MiB L3 evicted what the rest of the step reads from it (the
 * KV pool, the interpreter's working set). The engine's batch-1 step (`decode_overhead.py --streaming`, two
 * threads, Zen 5, alternated processes): int4-g32 1.93 -> 1.73 ms (medians of 9 and 8 runs at a 49-55 GB/s read
 * figure: 70-73 -> 75-85 % of it), 1.64-1.77 -> 1.56-1.63 ms at 84-86 GB/s; int8 even (2.30-2.44 against 2.28-2.40).
 * With the attention and the small GEMVs timed: attention ~200 -> ~165 us, o ~150 -> ~128 us a step. The L1
 * prefetch added behind the non-temporal one did no better. The 121 GEMVs alone, back to back (no step between):
 * even (48.9 against 49.0 GB/s). */
#define BYTES_AHEAD 12288
/* One x row as the byte pairs vpdpbusd takes for 4-bit codes: x = 256 * hi + lo exactly (hi signed, lo unsigned),
 * and per chunk four 32-bit words in the order a nibble plane's bytes hold the inputs (below): [hi of inputs 0,
 * 4, 1, 5], [lo of the same], [hi of 2, 6, 3, 7], [lo of the same]. */
static void x_byte_planes(const int16_t *xq, int64_t chunks, uint32_t *planes) {
    static const int inputs[2][4] = {{0, 4, 1, 5}, {2, 6, 3, 7}};
    for (int64_t c = 0; c < chunks; c++)
        for (int plane = 0; plane < 2; plane++) {
            uint32_t hi = 0, lo = 0;
            for (int b = 0; b < 4; b++) {
                const int16_t v = xq[c * 8 + inputs[plane][b]];
                hi |= (uint32_t)(uint8_t)(int8_t)(v >> 8) << (8 * b);
                lo |= (uint32_t)(uint8_t)(v & 0xff) << (8 * b);
            }
            planes[c * 4 + 2 * plane] = hi, planes[c * 4 + 2 * plane + 1] = lo;
        }
}

/* x_byte_planes four chunks a vector: each chunk's planes are a byte shuffle of its 16 bytes of int16 codes (hi:
 * the high byte, lo: the low one), so one vpshufb per 64 bytes does it; bitwise x_byte_planes. It was a scalar
 * loop per GEMV call (with the mallocs below, ~0.1-0.2 us of each call's hot fixed cost of ~0.6 us). */
static void x_byte_planes_512(const int16_t *xq, int64_t chunks, uint32_t *planes) {
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 9, 3, 11, 0, 8, 2, 10, 5, 13, 7, 15, 4, 12, 6, 14));
    int64_t c = 0;
    for (; c + 4 <= chunks; c += 4)
        _mm512_storeu_si512((void *)(planes + c * 4),
                            _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)(xq + c * 8)), order));
    if (c < chunks) x_byte_planes(xq + c * 8, chunks - c, planes + c * 4);
}

/* stream_block for 4-bit codes on byte dot products: a chunk's codes masked per byte are two planes, bytes
 * [inputs 0, 4, 1, 5] and (shifted by 4) [2, 6, 3, 7] of each row's 32-bit lane, and vpdpbusd multiplies a
 * plane by x's hi bytes (codes unsigned, hi signed) and x's lo bytes by the plane (lo unsigned, codes 0..15
 * signed). 3 shifts and ands a chunk instead of 6 for the same four dot products; the integers are the same
 * (256 * sum(hi * q) + sum(lo * q) = sum(x * q), no overflow: 256 * 128 * 15 * 256 < 2^31), so every output
 * is bitwise stream_block's. A SmolLM-135M token's 121 int4-g32 GEMVs, Zen 5: hot one thread 1.57-1.69 ->
 * 1.40-1.55 ns a chunk; cold two threads 44.6 -> 46.7 GB/s (median of 142 alternated passes). */
/* A 4-bit chunk's four dot products on byte planes (above), prefetching BYTES_AHEAD ahead. */
#define BYTES_CHUNK(chunk, xs, high_a, low_a, high_b, low_b)                                                  \
    {                                                                                                         \
        if ((chunk) + BYTES_AHEAD < end) _mm_prefetch((const char *)(chunk) + BYTES_AHEAD, _MM_HINT_NTA);     \
        const ivec words = iload(chunk);                                                                      \
        const ivec a = iand(words, low4), b = iand(isrl16(words, 4), low4);                                   \
        high_a = _mm512_dpbusd_epi32(high_a, a, _mm512_set1_epi32((int)(xs)[0]));                             \
        low_a = _mm512_dpbusd_epi32(low_a, _mm512_set1_epi32((int)(xs)[1]), a);                               \
        high_b = _mm512_dpbusd_epi32(high_b, b, _mm512_set1_epi32((int)(xs)[2]));                             \
        low_b = _mm512_dpbusd_epi32(low_b, _mm512_set1_epi32((int)(xs)[3]), b);                               \
    }

/* The exact int32 dot products of one block's 16 rows with x over `chunks` chunks from `at` (x's planes from
 * `xs`): eight chains (the chunk's parity x its two planes x hi/lo) hide vpdpbusd's latency, added at the end. */
INLINE ivec bytes_dot(const uint8_t *at, const uint32_t *xs, int64_t chunks, const uint8_t *end) {
    const ivec low4 = _mm512_set1_epi8(0x0f);
    ivec h0 = izero(), l0 = izero(), h1 = izero(), l1 = izero(), h2 = izero(), l2 = izero(), h3 = izero(), l3 = izero();
    int64_t c = 0;
#pragma GCC unroll 16
    for (; c + 2 <= chunks; c += 2) {
        BYTES_CHUNK(at + c * CHUNK, xs + c * 4, h0, l0, h1, l1)
        BYTES_CHUNK(at + (c + 1) * CHUNK, xs + (c + 1) * 4, h2, l2, h3, l3)
    }
    if (c < chunks) BYTES_CHUNK(at + c * CHUNK, xs + c * 4, h0, l0, h1, l1)
    const ivec high = _mm512_add_epi32(_mm512_add_epi32(h0, h1), _mm512_add_epi32(h2, h3));
    const ivec low = _mm512_add_epi32(_mm512_add_epi32(l0, l1), _mm512_add_epi32(l2, l3));
    return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
}

/* stream_block for 4-bit codes on byte dot products: a chunk's codes masked per byte are two planes, bytes
 * [inputs 0, 4, 1, 5] and (shifted by 4) [2, 6, 3, 7] of each row's 32-bit lane, and vpdpbusd multiplies a
 * plane by x's hi bytes (codes unsigned, hi signed) and x's lo bytes by the plane (lo unsigned, codes 0..15
 * signed). 3 shifts and ands a chunk instead of 6 for the same four dot products; the integers are the same
 * (256 * sum(hi * q) + sum(lo * q) = sum(x * q), no overflow: 256 * 128 * 15 * 256 < 2^31), so every output
 * is bitwise stream_block's. A SmolLM-135M token's 121 int4-g32 GEMVs, Zen 5: hot one thread 1.57-1.69 ->
 * 1.40-1.55 ns a chunk; cold two threads 44.6 -> 46.7 GB/s (median of 142 alternated passes).
 * An x block of a whole group (4, 8, 16 or 32 chunks: groups of 32 to 256) has its chunk count fixed at compile
 * time, so its loop unrolls with the chains in registers (gcc had kept them in copies, ten vmovdqa a chunk pair),
 * and its group is the x block's index (there was a 64-bit idiv per x block). Zen 4 (EPYC, family 25 model 17),
 * hot, one thread, 576x1536: g32 2.01 -> 1.87 ns a chunk, g64 1.67 -> 1.63, g128 1.60 -> 1.50, g256 1.52 -> 1.43,
 * per row 1.51 -> 1.40; cold (a token's 121 int4-g32 GEMVs, two threads, 100 alternated passes) even: the
 * stream is memory-bound there. */
INLINE fvec bytes_blocks(const int CPX, const uint8_t *base, const uint16_t *scales, const uint16_t *zeros,
                         const Prepared *p, const uint32_t *planes, int64_t xb_per_group, int64_t chunks_per_x_block,
                         const uint8_t *end) {
    const fvec midpoint = fset1(8.0f);
    const int64_t cpx = CPX ? CPX : chunks_per_x_block;
    fvec acc = fzero();
    for (int64_t xb = 0; xb < p->x_blocks; xb++) {
        const ivec dot = bytes_dot(base + xb * cpx * CHUNK, planes + xb * cpx * 4, cpx, end);
        acc = add_x_block(acc, dot, scales, zeros, midpoint, p, (CPX ? xb : xb / xb_per_group) * BLOCK, xb);
    }
    return acc;
}

INLINE void stream_block_bytes(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, const Prepared *p,
                               const uint32_t *planes, const uint16_t *bias, uint16_t *y, int64_t block, int64_t n,
                               int64_t k, int64_t group, const uint8_t *end) {
    const int64_t chunks = k / 8, groups = k / group, cpx = p->x_block / 8, xb_per_group = group / p->x_block;
    const uint8_t *base = codes + block * chunks * CHUNK;
    const uint16_t *s = scales + block * groups * BLOCK, *z = zeros != NULL ? zeros + block * groups * BLOCK : NULL;
    fvec acc;
    if (xb_per_group == 1 && cpx == 4) acc = bytes_blocks(4, base, s, z, p, planes, 1, cpx, end);
    else if (xb_per_group == 1 && cpx == 8) acc = bytes_blocks(8, base, s, z, p, planes, 1, cpx, end);
    else if (xb_per_group == 1 && cpx == 16) acc = bytes_blocks(16, base, s, z, p, planes, 1, cpx, end);
    else if (xb_per_group == 1 && cpx == 32) acc = bytes_blocks(32, base, s, z, p, planes, 1, cpx, end);
    else acc = bytes_blocks(0, base, s, z, p, planes, xb_per_group, cpx, end);
    store_rows(y, bias, block * BLOCK, n, acc);
}
#undef BYTES_CHUNK
#else
#define BYTE_PLANES 0
#endif

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
        } else if (bits == 6) {
            if (MR == 1) WIDTHS(6, 1); else if (MR == 2) WIDTHS(6, 2); else WIDTHS(6, 4);
        } else if (bits == IQ4_CODES) {
            if (MR == 1) WIDTHS(IQ4_CODES, 1); else if (MR == 2) WIDTHS(IQ4_CODES, 2); else WIDTHS(IQ4_CODES, 4);
        } else {
            if (MR == 1) WIDTHS(4, 1); else if (MR == 2) WIDTHS(4, 2); else WIDTHS(4, 4);
        }
        b += T;
    }
}

/* The linear a caller runs next (quant_gemv_bf16_chain): its codes, scales, zeros (NULL: the midpoint) and shape,
 * and the threads it will be given. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *zeros;
    int64_t n, k, group;
    int bits, num_threads;
} Next;

/* Each thread, done with its blocks, prefetches into L2 the first NEXT_AHEAD bytes of its share of the next
 * linear's codes and the first NEXT_SCALES_AHEAD of its scales (and zeros): that GEMV then starts on them
 * instead of on DRAM's latency while its own prefetching gets ahead. The 121 int4-g32 GEMVs of a SmolLM-135M
 * token, called from C one after another, cold, two threads, alternated pass by pass with a 256 MiB read (Zen 5):
 * +2-3 % GB/s (read ~40 GB/s: 36.0 -> 36.5-36.6 over 60 passes, paired median 1.022-1.029; ~57 GB/s: +3.1 %
 * over 49); 4, 12 and 24 KiB did the same. */
#define NEXT_AHEAD 12288
#define NEXT_SCALES_AHEAD 1024
static void prefetch_next(const Next *next, int64_t me) {
    const int64_t blocks = (next->n + BLOCK - 1) / BLOCK;
    const int64_t threads = next->num_threads < 1 ? 1 : (next->num_threads > blocks ? blocks : next->num_threads);
    if (me >= threads) return;
    const int64_t first = blocks * me / threads, last = blocks * (me + 1) / threads;
    const int64_t block_bytes = next->k / step_of(next->bits) * chunk_bytes(next->bits);
    const int64_t group_bytes = next->k / next->group * BLOCK * 2;
    const int64_t code_bytes = (last - first) * block_bytes < NEXT_AHEAD ? (last - first) * block_bytes : NEXT_AHEAD;
    const int64_t scale_bytes = (last - first) * group_bytes < NEXT_SCALES_AHEAD ? (last - first) * group_bytes
                                                                                   : NEXT_SCALES_AHEAD;
    for (int64_t at = 0; at < code_bytes; at += 64)
        _mm_prefetch((const char *)(next->codes + first * block_bytes + at), _MM_HINT_T1);
    for (int64_t at = 0; at < scale_bytes; at += 64) {
        _mm_prefetch((const char *)next->scales + first * group_bytes + at, _MM_HINT_T1);
        if (next->zeros != NULL) _mm_prefetch((const char *)next->zeros + first * group_bytes + at, _MM_HINT_T1);
    }
}

/* Thread `me`'s blocks against x (prepared before for one row; by the threads for the wide tiles' xw, NULL where
 * they are unused; planes: one row's byte planes or NULL); then the next linear's prefetch (next: NULL for none).
 * Called by every thread of a parallel region of `threads` (the team's size: all of x's blocks are computed even
 * where the runtime gives fewer threads than asked). */
static void thread_share(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                         const Prepared *p, const uint16_t *x, int16_t *xw, const uint32_t *planes, const uint16_t *bias,
                         uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t threads, int64_t me,
                         const Next *next) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, step = step_of(bits);
    (void)planes; /* read by the AVX-512 VNNI body only */
    const int64_t first = blocks * me / threads, last = blocks * (me + 1) / threads;
    if (xw != NULL) { /* x prepared by all the threads, a group of WIDE_MR rows at a time */
#pragma omp for schedule(static)
        for (int64_t g = 0; g < m; g += WIDE_MR) {
            const int64_t end = g + WIDE_MR < m ? g + WIDE_MR : m;
            prepare_rows(x, g, end, k, p);
            /* fixed-size copies, inlined: a libc memcpy call per 8 or 16 bytes cost ~1 ms of a 32-row int8 step */
            for (int64_t c = 0; end - g == WIDE_MR && c < k / step; c++)
                for (int64_t r = 0; r < WIDE_MR; r++) {
                    int16_t *to = xw + g * k + (c * WIDE_MR + r) * step;
                    const int16_t *from = p->xq + (g + r) * k + c * step;
                    if (step == 4) memcpy(to, from, 4 * sizeof(int16_t));
                    else memcpy(to, from, 8 * sizeof(int16_t));
                }
        }
    }
#if ISA == 512
    if (m == 1) {
        /* The thread's share ends here and its stream prefetches no further: past it the lines were the
         * other thread's (already read, and non-temporal lines are not kept in L3) or another tensor's, fetched
         * for nothing, STREAM_AHEAD or BYTES_AHEAD bytes a call a thread (up to 13 % of a 576x576 int4 weight).
         * A SmolLM-135M int4-g32 token's 121 GEMVs (C driver, 2 MiB pages, two threads, Zen 4, alternated):
         * 32.9 -> 33.6 GB/s (20 passes, read figure ~36) and 37.4 -> 38.0 (30 passes, ~60); int8 even. */
        const uint8_t *end = codes + last * (k / step) * chunk_bytes(bits);
        for (int64_t block = first; block < last; block++) {
#if BYTE_PLANES
            if (planes != NULL) {
                stream_block_bytes(codes, scales, zeros, p, planes, bias, y, block, n, k, group, end);
                continue;
            }
#endif
            if (bits == 8) stream_block(8, codes, scales, zeros, p, bias, y, block, n, k, group, end);
            else if (bits == 6) stream_block(6, codes, scales, zeros, p, bias, y, block, n, k, group, end);
            else if (bits == IQ4_CODES) stream_block(IQ4_CODES, codes, scales, zeros, p, bias, y, block, n, k, group, end);
            else stream_block(4, codes, scales, zeros, p, bias, y, block, n, k, group, end);
        }
    } else
#endif
    /* TILE blocks at a time for all the x rows: the tile's codes are re-read from L1/L2 for later rows */
    for (int64_t block = first; block < last; block += TILE) {
        const int64_t width = last - block < TILE ? last - block : TILE;
        for (int64_t r0 = 0; r0 < m;) {
#if ISA == 512
            if (m - r0 >= WIDE_MR) {
                run_wide(bits, codes, scales, zeros, p, xw + r0 * k, bias, y, block, width, r0, n, k, group);
                r0 += WIDE_MR;
                continue;
            }
#endif
            const int MR = x_rows(m - r0);
            run_rows(bits, MR, codes, scales, zeros, p, bias, y, block, width, r0, n, k, group);
            r0 += MR;
        }
    }
    if (next != NULL) prefetch_next(next, me);
}

/* The threads' shares (thread_share) with x prepared before, shared. */
static void gemv_run(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, const Prepared *p,
                     const uint16_t *x, int16_t *xw, const uint32_t *planes, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k, int64_t group, int64_t threads, const Next *next) {
#pragma omp parallel num_threads(threads)
    thread_share(bits, codes, scales, zeros, p, x, xw, planes, bias, y, m, n, k, group, omp_get_num_threads(),
                 omp_get_thread_num(), next);
}

/* One x row of up to this many inputs is prepared into buffers on the caller's stack (at most 32 KiB, within a
 * small thread stack such as musl's 128 KiB), not the heap: four mallocs and frees were part of each GEMV's
 * fixed cost (hot, two threads, 121 calls in a row: 64x64 int4-g32 0.68 -> 0.58 us a call, 64x1536 1.82 -> 1.64 us
 * with the byte planes' vpshufb). */
#define STACK_INPUTS_MAX 8192

/* Thread `me`'s share of one row's GEMV (of `threads`), x prepared into `xq`, `xscale`, `xsum` and `planes` (the
 * thread's own buffers: k int16 codes, k / x_block floats each, k / 2 words where the byte planes are used). */
static void row_share(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, const uint16_t *x,
                      const uint16_t *bias, uint16_t *y, int64_t n, int64_t k, int64_t group, int64_t threads,
                      int64_t me, const Next *next, int16_t *xq, float *xscale, float *xsum, uint32_t *planes) {
    const int64_t x_block = x_block_of(group, bits);
    const Prepared prepared = {xq, xscale, xsum, x_block, k / x_block};
    prepare_rows(x, 0, 1, k, &prepared);
    const int byte_planes = BYTE_PLANES && bits == 4;
#if BYTE_PLANES
    if (byte_planes) x_byte_planes_512(xq, k / 8, planes);
#endif
    thread_share(bits, codes, scales, zeros, &prepared, x, NULL, byte_planes ? planes : NULL, bias, y, 1, n, k, group,
                 threads, me, next);
}

/* row_share with the thread's buffers on its stack (k <= STACK_INPUTS_MAX). */
static void row_share_on_stack(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                               const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k,
                               int64_t group, int64_t threads, int64_t me, const Next *next) {
    const int64_t blocks_of_x = k / x_block_of(group, bits);
    int16_t xq[k] __attribute__((aligned(64)));
    float xscale[blocks_of_x], xsum[blocks_of_x];
    uint32_t planes[BYTE_PLANES && bits == 4 ? k / 2 : 1] __attribute__((aligned(64)));
    row_share(bits, codes, scales, zeros, x, bias, y, n, k, group, threads, me, next, xq, xscale, xsum, planes);
}

/* quant_gemv_bf16, then `next` prefetched (NULL: nothing). */
static int gemv_then(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x_,
                     const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads,
                     const Next *next) {
    if (m < 1 || !covered(bits, n, k, group)) return 0;
    const uint8_t *codes = (const uint8_t *)weight;
    const uint16_t *scales = (const uint16_t *)scales_, *zeros = (const uint16_t *)zeros_, *x = (const uint16_t *)x_;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *y = (uint16_t *)y_;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, x_block = x_block_of(group, bits);
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > blocks ? blocks : num_threads);
    const int byte_planes = BYTE_PLANES && m == 1 && bits == 4;
    if (m == 1 && k <= STACK_INPUTS_MAX) {
        /* Each thread prepares x itself, on its own stack: the bf16 row is all it reads of another core's writes,
         * where x's int16 codes, scales and byte planes prepared by the calling thread were three times the lines
         * (each ~190 ns from a core of another CCD), and the other threads waited for the preparation. A token's
         * 121 int4-g32 GEMVs (C driver, 2 MiB pages, two threads of a Zen 4 VM, alternated): vCPUs on two CCDs
         * 38.2 -> 41.9 GB/s (179 passes, faster in 177), on one CCD 32.1 -> 32.2 (4282 passes); int8 on two CCDs
         * 40.4 -> 43.2 (12). */
#pragma omp parallel num_threads(threads)
        row_share_on_stack(bits, codes, scales, zeros, x, bias, y, n, k, group, omp_get_num_threads(),
                           omp_get_thread_num(), next);
        return 1;
    }
    Prepared prepared, *p = &prepared;
    if (!prepare_alloc(m, k, x_block, p)) return 0;
    /* the AVX-512 body's wide tiles read x rows packed per chunk: xw [m / WIDE_MR][chunk][WIDE_MR][step] */
    const int64_t wide_rows = ISA == 512 ? m / WIDE_MR * WIDE_MR : 0;
    int16_t *xw = wide_rows > 0 ? (int16_t *)malloc(sizeof(int16_t) * (size_t)(wide_rows * k)) : NULL;
    uint32_t *planes = byte_planes ? (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(k / 2)) : NULL;
    if ((wide_rows > 0 && xw == NULL) || (byte_planes && planes == NULL)) {
        free(p->xq), free(p->xscale), free(p->xsum), free(xw), free(planes);
        return 0;
    }
    if (wide_rows == 0) prepare_rows(x, 0, m, k, p); /* few rows: no barrier in the region */
#if BYTE_PLANES
    if (planes != NULL) x_byte_planes_512(p->xq, k / 8, planes);
#endif
    gemv_run(bits, codes, scales, zeros, p, x, xw, planes, bias, y, m, n, k, group, threads, next);
    free(p->xq), free(p->xscale), free(p->xsum), free(xw), free(planes);
    return 1;
}

/* Returns 0 (nothing computed) for shapes the layout does not cover; the caller checks them first. */
int quant_gemv_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    return gemv_then(weight, scales, zeros, bits, x, bias, y, m, n, k, group, num_threads, NULL);
}

/* quant_gemv_bf16 for a caller that knows the linear it runs next (decode_stack_bf16): the same outputs, then each
 * thread prefetches the start of its share of that linear's weight (prefetch_next). next_codes NULL: none. */
int quant_gemv_bf16_chain(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                          const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads,
                          const void *next_codes, const void *next_scales, const void *next_zeros, int next_bits,
                          int64_t next_n, int64_t next_k, int64_t next_group) {
    const Next next = {(const uint8_t *)next_codes, (const uint16_t *)next_scales, (const uint16_t *)next_zeros,
                       next_n, next_k, next_group, next_bits, num_threads};
    const int usable = next_codes != NULL && next_scales != NULL && covered(next_bits, next_n, next_k, next_group);
    return gemv_then(weight, scales, zeros, bits, x, bias, y, m, n, k, group, num_threads, usable ? &next : NULL);
}

/* quant_gemv_bf16_chain's one row run by thread `me` of a parallel region of `threads` that the caller already holds
 * (cpu_kernels.c's one-region decode step): the thread's share of y, x prepared into its own buffers, then its
 * share of `next` prefetched; no region, no barrier (the caller's follows). Returns 0 (nothing computed) for shapes
 * the layout does not cover, or where a thread's buffers for more than STACK_INPUTS_MAX inputs find no memory. */
int quant_gemv_bf16_share(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                          const void *bias, void *y, int64_t n, int64_t k, int64_t group, int me, int threads,
                          const void *next_codes, const void *next_scales, const void *next_zeros, int next_bits,
                          int64_t next_n, int64_t next_k, int64_t next_group) {
    if (!covered(bits, n, k, group) || threads < 1 || me < 0 || me >= threads) return 0;
    const Next next = {(const uint8_t *)next_codes, (const uint16_t *)next_scales, (const uint16_t *)next_zeros,
                       next_n, next_k, next_group, next_bits, threads};
    const Next *then = next_codes != NULL && next_scales != NULL && covered(next_bits, next_n, next_k, next_group)
                           ? &next : NULL;
    if (k <= STACK_INPUTS_MAX) {
        row_share_on_stack(bits, (const uint8_t *)weight, (const uint16_t *)scales, (const uint16_t *)zeros,
                           (const uint16_t *)x, (const uint16_t *)bias, (uint16_t *)y, n, k, group, threads, me, then);
        return 1;
    }
    const int64_t blocks_of_x = k / x_block_of(group, bits);
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)k);
    float *xscale = (float *)malloc(sizeof(float) * (size_t)(2 * blocks_of_x));
    uint32_t *planes = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(k / 2));
    const int ok = xq != NULL && xscale != NULL && planes != NULL;
    if (ok)
        row_share(bits, (const uint8_t *)weight, (const uint16_t *)scales, (const uint16_t *)zeros, (const uint16_t *)x,
                  (const uint16_t *)bias, (uint16_t *)y, n, k, group, threads, me, then, xq, xscale,
                  xscale + blocks_of_x, planes);
    free(xq), free(xscale), free(planes);
    return ok;
}

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

/* 16 vectors of 16 floats transposed in place (v[i][j] <- v[j][i]): four rounds of lane shuffles. A gather per
 * 16 outputs was most of the dequantisation (one thread, into a reused buffer, Zen 5: 960x576 284 -> 57 us,
 * 576x1536 457 -> 90 us). */
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
int quant_gemv_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                    const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0;
}
int quant_gemv_bf16_chain(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                          const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads,
                          const void *next_codes, const void *next_scales, const void *next_zeros, int next_bits,
                          int64_t next_n, int64_t next_k, int64_t next_group) {
    (void)next_codes, (void)next_scales, (void)next_zeros, (void)next_bits, (void)next_n, (void)next_k, (void)next_group;
    return quant_gemv_bf16(weight, scales, zeros, bits, x, bias, y, m, n, k, group, num_threads);
}
int quant_gemv_bf16_share(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                          const void *bias, void *y, int64_t n, int64_t k, int64_t group, int me, int threads,
                          const void *next_codes, const void *next_scales, const void *next_zeros, int next_bits,
                          int64_t next_n, int64_t next_k, int64_t next_group) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)n, (void)k, (void)group;
    (void)me, (void)threads, (void)next_codes, (void)next_scales, (void)next_zeros, (void)next_bits, (void)next_n;
    (void)next_k, (void)next_group;
    return 0;
}
int quant_dequantize_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                          int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)out, (void)n, (void)k, (void)group, (void)num_threads;
    return 0;
}
#endif

/* ---- AMX: dequantised once per call into B tiles, each tile reused by every row of the call -----------------
 * y = x W^T (+ bias) for many rows (batched decode, prefill) on AMX tiles, the weight staying in the layout
 * above. Per 32-output pair (two 16-row blocks) and 32 inputs the codes become one bf16 B tile per block (16
 * input pairs x 16 outputs, VNNI order): the layout's 16-bit words already hold, in lane 2i + e, row i's codes
 * of two neighbouring inputs, i.e. a B tile row once widened to float, (q - zero) * scale and rounded to bf16.
 * That is quant_dequantize_bf16's value (float32 subtract and multiply, or one fused multiply-add where that
 * is exactly the same rounding, see amx_group; one round to nearest even), so each weight is bitwise the one it
 * returns, and each output element is gemm_amx_bf16's (cpu_kernels.c) on that dequantised weight: its C tile
 * element fed K in 32-wide steps in order from zero, then the bias added in float32 and one rounding. It
 * depends on its own row of x only: an M-row call is bitwise M one-row calls.
 * dequantize_tile makes one B tile: ~3 ns per tile row of 32 weights from L1 (one thread, loaded host), a third
 * of it vcvtne2ps2bf16 (without it 2.0 ns; the shift, mask and conversion of the codes cut to one ternary-logic
 * op for 4 bits: 3.1 -> 2.7-3.0 ns).
 * Threads take runs of AMX_RUN_PAIRS pairs from a shared counter, each run 32 rows (A tiles 4-5) x one pair
 * (B tiles 6-7) -> C tiles 0-3 per item (amx_pairs), the dequantisation paid once per call whatever M is, on
 * one of two schedules:
 * - interleaved: a ring of two pairs' tiles, the next tiles dequantised between the dot products of the current
 *   ones (8-bit codes; 4-bit up to 32 rows);
 * - panels: AMX_PANEL_BYTES of tiles dequantised (a block's codes in order), then all the rows against them.
 * The out-of-order core does not overlap the vector dequantisation with the TMUL here: cold 3072x576 int4-g32,
 * 64 rows, one thread, took the dequantisation alone plus the dot products alone (945 ~ 387 + 543 us, loaded
 * host); the ring wins by locality (tiles read back from L1 instead of a 512 KB panel in L2), except for 4-bit
 * codes and more rows (alternated, thread CPU time, cold, one thread, us, panels / interleaved: 3072x576 int8 16
 * rows 325 / 274, 64 rows 462 / 406, 128 rows 701 / 675; 576x1536 int8 16 rows 164 / 128; 3072x576 int4-g32 64
 * rows 387 / 426, 128 rows 604 / 665; 576x1536 int4-g32 128 rows 245 / 281). */
#if ISA == 512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */

/* Linux hands AMX's tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 when granted (the permission is the process's, for all its threads). */
int quant_amx_enable(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_tile_config;

#define AMX_RUN_PAIRS 8 /* pairs a thread takes at a time */
#define AMX_STEP_WORDS 1024 /* bf16 values of one pair's two B tiles per 32 inputs */
#define AMX_PANEL_BYTES (512 * 1024) /* a panel's dequantised tiles (L2), for all the rows */
/* With one row item per pair (up to 32 rows) the B tiles are dequantised this many K steps ahead of the
 * dot products that read them, so they are read back from L1 */
#define AMX_LEAD_STEPS 2

/* The B tile rows of one chunk's codes: its 64 bytes' 16-bit words (word 2i + e: row i, input e of each of its
 * input pairs) widened once per chunk, words 0-15 (rows 0-7) in `lo`, 16-31 in `hi`, so each input pair's codes
 * are a shift and a mask away. Its group's zeros and scales spread to those lanes (zero_lo, scale_lo: rows 0-7).
 * (q - zero) * scale is quant_dequantize_bf16's float32 subtract and multiply, or where the group allows it
 * (`fused`: every scale positive and finite, every zero an integer) one fused q * scale + (-zero * scale):
 * zero * scale is exact (two float16 values: 22 significant bits at most), q - zero is exact (integers), so
 * both are the one rounding of the same (q - zero) * scale, +0 where q = zero, bitwise the same weight. */
typedef struct {
    __m512 zero_lo, zero_hi, scale_lo, scale_hi, offset_lo, offset_hi; /* offset: -zero * scale */
    __m512 base_lo[4], base_hi[4]; /* 4 bits, `embedded`: -(AMX_NIBBLE_BASE[t] + zero) * scale */
    int fused, embedded;
} amx_group;

/* 4 bits, `embedded`: nibble t of a widened word masked in place (shifted left 11 first for t < 3: the bits
 * AMX_NIBBLE_AT[t]) under the exponent of AMX_NIBBLE_BASE[t] = 2^(23 - AMX_NIBBLE_AT[t]) is the float32
 * AMX_NIBBLE_BASE[t] + q (one ternary-logic op instead of a shift, a mask and a conversion), and
 * (base + q) * scale + (-(base + zero) * scale) is one fused multiply-add of exact terms wherever `fused` holds:
 * base + zero, for any integer a float16 holds, spans 13 significant bits at most, times the scale's 11 still
 * fits float32's 24, so it is the same one rounding of (q - zero) * scale again. */
static const int AMX_NIBBLE_AT[4] = {11, 15, 19, 12};
static const float AMX_NIBBLE_BASE[4] = {4096.0f, 256.0f, 16.0f, 2048.0f};

INLINE void amx_group_load(const int BITS, const uint16_t *scales, const uint16_t *zeros, int64_t at, amx_group *g) {
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512 scale = fload_f16(scales + at);
    const __m512 zero = zeros != NULL ? fload_f16(zeros + at) : fset1(BITS == 8 ? 128.0f : 8.0f);
    const __mmask16 positive = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_GT_OQ) &
                               _mm512_cmp_ps_mask(scale, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const __mmask16 integral = _mm512_cmp_ps_mask(_mm512_roundscale_ps(zero, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                                                  zero, _CMP_EQ_OQ);
    g->fused = (__mmask16)(positive & integral) == (__mmask16)0xffff;
    g->embedded = BITS == 4 && g->fused;
    const __m512 offset = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zero, scale));
    g->scale_lo = _mm512_permutexvar_ps(pairs_lo, scale), g->scale_hi = _mm512_permutexvar_ps(pairs_hi, scale);
    g->zero_lo = _mm512_permutexvar_ps(pairs_lo, zero), g->zero_hi = _mm512_permutexvar_ps(pairs_hi, zero);
    g->offset_lo = _mm512_permutexvar_ps(pairs_lo, offset), g->offset_hi = _mm512_permutexvar_ps(pairs_hi, offset);
    if (g->embedded)
        for (int t = 0; t < 4; t++) { /* exact: -base * scale (a power of two times it) + offset is representable */
            const __m512 base = _mm512_set1_ps(AMX_NIBBLE_BASE[t]);
            g->base_lo[t] = _mm512_fnmadd_ps(base, g->scale_lo, g->offset_lo);
            g->base_hi[t] = _mm512_fnmadd_ps(base, g->scale_hi, g->offset_hi);
        }
}

/* `embedded` (above): input pair t's B tile row from a chunk's widened words (lo: words 0-15, hi: 16-31) and
 * the same shifted left 11. */
INLINE void dequantize_row_embedded(__m512i lo, __m512i hi, __m512i lo11, __m512i hi11, const amx_group *g, int t,
                                    uint16_t *dst) {
    const __m512i mask = _mm512_set1_epi32(0xf << AMX_NIBBLE_AT[t]);
    const __m512i exponent = _mm512_castps_si512(_mm512_set1_ps(AMX_NIBBLE_BASE[t]));
    const __m512 x_lo = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(t < 3 ? lo11 : lo, mask, exponent, 0xea));
    const __m512 x_hi = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(t < 3 ? hi11 : hi, mask, exponent, 0xea));
    const __m512 w_lo = _mm512_fmadd_ps(x_lo, g->scale_lo, g->base_lo[t]);
    const __m512 w_hi = _mm512_fmadd_ps(x_hi, g->scale_hi, g->base_hi[t]);
    _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

/* Input pair t of the chunk (8 bits: the low then the high bytes; 4 bits: nibbles 0-3) from its widened words. */
INLINE __m512i amx_codes(const int BITS, __m512i words32, int t) {
    if (BITS == 8) return t == 0 ? _mm512_and_si512(words32, _mm512_set1_epi32(0xff)) : _mm512_srli_epi32(words32, 8);
    if (t == 3) return _mm512_srli_epi32(words32, 12);
    const __m512i shifted = t == 0 ? words32 : _mm512_srli_epi32(words32, 4 * t);
    return _mm512_and_si512(shifted, _mm512_set1_epi32(0xf));
}

/* One B tile row (an input pair for 16 outputs) from the pair's codes (lo: words 0-15, hi: 16-31). */
INLINE void dequantize_row(__m512i q_lo, __m512i q_hi, const amx_group *g, uint16_t *dst) {
    const __m512 lo = _mm512_cvtepi32_ps(q_lo), hi = _mm512_cvtepi32_ps(q_hi);
    __m512 w_lo, w_hi;
    if (g->fused) {
        w_lo = _mm512_fmadd_ps(lo, g->scale_lo, g->offset_lo);
        w_hi = _mm512_fmadd_ps(hi, g->scale_hi, g->offset_hi);
    } else {
        w_lo = _mm512_mul_ps(_mm512_sub_ps(lo, g->zero_lo), g->scale_lo);
        w_hi = _mm512_mul_ps(_mm512_sub_ps(hi, g->zero_hi), g->scale_hi);
    }
    _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

/* One B tile: block `block`'s 16 outputs x inputs [32 s, 32 s + 32) as 16 input pairs (rows of 32 values) at
 * dst; the pairs past k are zero. The codes stream from DRAM in batched decode: prefetched PREFETCH_CHUNKS
 * ahead in the block (a block's K in order: panels, the whole weight), or with `next_pair` the same chunk and
 * group of block + 2, the next pair's (the interleaved ring's order: cold, one thread, alternated, 16 rows,
 * 49152x576 int4-g32 5818 -> 4598 us, 3072x576 int4-g32 291 -> 245, int8 302 -> 255; panels measured slower
 * with it: 3072x576 int4-g32 at 128 rows 886 -> 1004). Prefetching never faults. */
INLINE void dequantize_tile(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                            int64_t block, int64_t k, int64_t group, int64_t s, int next_pair, uint16_t *dst) {
    const int64_t step = BITS == 8 ? 4 : 8, chunks = k / step, groups = k / group;
    const int64_t chunks_per_group = group / step; /* whole chunks (covered() checks it) */
    const int64_t first = s * (32 / step), last = first + 32 / step < chunks ? first + 32 / step : chunks;
    const uint8_t *base = codes + block * chunks * CHUNK;
    int64_t index = first / chunks_per_group, next = (index + 1) * chunks_per_group; /* next: group index + 1's */
    amx_group g;
    amx_group_load(BITS, scales, zeros, (block * groups + index) * BLOCK, &g);
    for (int64_t c = first; c < last; c++) {
        if (c == next) { /* no division per chunk */
            index++, next += chunks_per_group;
            amx_group_load(BITS, scales, zeros, (block * groups + index) * BLOCK, &g);
        }
        if (next_pair) {
            _mm_prefetch((const char *)(base + (2 * chunks + c) * CHUNK), _MM_HINT_T0);
            if (c == first) _mm_prefetch((const char *)(scales + ((block + 2) * groups + index) * BLOCK), _MM_HINT_T0);
        } else {
            _mm_prefetch((const char *)(base + (c + PREFETCH_CHUNKS) * CHUNK), _MM_HINT_T0);
        }
        const __m512i words = _mm512_loadu_si512((const void *)(base + c * CHUNK));
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1));
        if (BITS == 4 && g.embedded) {
            const __m512i lo11 = _mm512_slli_epi32(lo, 11), hi11 = _mm512_slli_epi32(hi, 11);
            for (int t = 0; t < 4; t++) dequantize_row_embedded(lo, hi, lo11, hi11, &g, t, dst + ((c - first) * 4 + t) * 32);
            continue;
        }
        for (int t = 0; t < step / 2; t++)
            dequantize_row(amx_codes(BITS, lo, t), amx_codes(BITS, hi, t), &g,
                           dst + ((c - first) * (step / 2) + t) * 32);
    }
    for (int64_t pair = (last - first) * (step / 2); pair < 16; pair++) /* inputs past k (k is even) */
        memset(dst + pair * 32, 0, 64);
}

/* Tile `half` (0, 1) of pair p's K step s; a block past the last (n's last pair may have one, pack_amx pads n
 * to 64) is zero weights, never stored. */
INLINE void dequantize_unit(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                            int64_t p, int64_t half, int64_t s, int64_t blocks, int64_t k, int64_t group, int next_pair,
                            uint16_t *dst) {
    const int64_t block = 2 * p + half;
    if (block < blocks) dequantize_tile(BITS, codes, scales, zeros, block, k, group, s, next_pair, dst);
    else memset(dst, 0, 1024);
}

/* Pair p's two B tiles per step (kp / 32 * 1024 values at `tiles`). */
static void dequantize_pair(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t p,
                            int64_t blocks, int64_t k, int64_t kp, int64_t group, uint16_t *tiles) {
    for (int64_t half = 0; half < 2; half++) /* a block's codes in order: one stream */
        for (int64_t s = 0; s < kp / 32; s++) {
            uint16_t *dst = tiles + s * AMX_STEP_WORDS + half * 512;
            if (bits == 8) dequantize_unit(8, codes, scales, zeros, p, half, s, blocks, k, group, 0, dst);
            else dequantize_unit(4, codes, scales, zeros, p, half, s, blocks, k, group, 0, dst);
        }
}

/* The whole weight dequantised into cpu_kernels.c's gemm_amx_bf16 layout (kernels/__init__.py's pack_amx: n
 * padded to 64, k to 32, [n / 32][k / 32][2][16 pairs][16][2]): for row counts where that kernel's blocking
 * beats the pipelined one below; each output is bitwise the same. Returns 0 for shapes not covered. */
int quant_dequantize_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                              int64_t k, int64_t group, int num_threads) {
    if (!amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const int64_t kp = (k + 31) / 32 * 32, pairs = (n + 63) / 64 * 2, blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        dequantize_pair(bits, (const uint8_t *)weight, (const uint16_t *)scales, (const uint16_t *)zeros, p, blocks, k,
                        kp, group, (uint16_t *)out + p * (kp / 32) * AMX_STEP_WORDS);
    return 1;
}

/* gemm_amx_bf16's rounding (cpu_kernels.c round_bf16): nearest even on the bits, NaN kept */
INLINE __m512i amx_round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bits), 16);
}

/* C tile `tile` (16 rows of 16 floats) + bias into y's rows [row0, row0 + rows), columns [col0, col0 + 16). */
INLINE void amx_store(int tile, float *scratch, const uint16_t *bias, uint16_t *y, int64_t row0, int64_t rows,
                      int64_t col0, int64_t n) {
    if (col0 >= n) return;
    switch (tile) { /* tile numbers must be immediates */
    case 0: _tile_stored(0, scratch, 64); break;
    case 1: _tile_stored(1, scratch, 64); break;
    case 2: _tile_stored(2, scratch, 64); break;
    default: _tile_stored(3, scratch, 64); break;
    }
    const __mmask16 live = n - col0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col0)) - 1u);
    const __m512 b = bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                        _mm256_maskz_loadu_epi16(live, bias + col0)), 16))
                                  : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 value = _mm512_load_ps(scratch + 16 * r);
        if (bias != NULL) value = _mm512_add_ps(value, b);
        _mm256_mask_storeu_epi16(y + (row0 + r) * n + col0, live, _mm512_cvtepi32_epi16(amx_round_bf16(value)));
    }
}

/* The dequantisation of a thread's pairs as a stream of units (one B tile: a pair's K step, one half), written
 * into a ring of two pairs' tiles while the dot products read the other. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *zeros;
    int64_t blocks, k, group, steps;
    uint16_t *ring;  /* [2][steps][1024] */
    int64_t pair, s, half; /* the next unit */
    int64_t made, total;   /* units dequantised, units of the thread's pairs */
} amx_producer;

INLINE void amx_produce(const int BITS, amx_producer *p) {
    if (p->made == p->total) return;
    uint16_t *dst = p->ring + (p->made / (2 * p->steps) % 2) * p->steps * AMX_STEP_WORDS + p->s * AMX_STEP_WORDS +
                    p->half * 512;
    dequantize_unit(BITS, p->codes, p->scales, p->zeros, p->pair, p->half, p->s, p->blocks, p->k, p->group, 1, dst);
    p->made++;
    if (++p->half == 2) {
        p->half = 0;
        if (++p->s == p->steps) p->s = 0, p->pair++;
    }
}

/* A thread's pairs [first, last) against rows [0, mp) of the (padded) x, in items of 32 rows (A tiles 4-5) x
 * one pair (B tiles 6-7) -> C tiles 0-3 (a lone last 16-row tile: C 0-1); pair p's tiles lie in slot
 * (p - first) % slots of the ring. Two schedules of the dequantisation:
 * - interleaved (a ring of 2 slots): the units dequantised `lead` ahead of the first dot product that reads them,
 *   then evenly over the pair's K steps x row items, between the dot products: one row item (up to 32 rows, each
 *   tile read once) leads by AMX_LEAD_STEPS steps (its tiles read back from L1), more items by a whole pair (its
 *   tiles re-read by every item);
 * - panels (`slots` pairs, AMX_PANEL_BYTES): every `slots` pairs dequantised first (a block's K in order), then
 *   run against all the rows. */
INLINE void amx_pairs(const int BITS, const uint16_t *a, amx_producer *producer, int interleaved, int64_t slots,
                      const uint16_t *bias, uint16_t *y, int64_t m, int64_t mp, int64_t n, int64_t kp, int64_t first,
                      int64_t last, float *scratch) {
    const int64_t steps = kp / 32, items = (mp + 31) / 32, per_pair = 2 * steps, iterations = items * steps;
    const int64_t lead = items == 1 && 2 * AMX_LEAD_STEPS < per_pair ? 2 * AMX_LEAD_STEPS : per_pair;
    while (interleaved && producer->made < lead && producer->made < producer->total) amx_produce(BITS, producer);
    int64_t owed = 0; /* Bresenham: per_pair units every `iterations` dot-product steps */
    for (int64_t p = first; p < last; p++) {
        const uint16_t *tiles = producer->ring + (p - first) % slots * steps * AMX_STEP_WORDS;
        if (!interleaved && (p - first) % slots == 0)
            for (int64_t q = p; q < last && q < p + slots; q++)
                dequantize_pair(BITS, producer->codes, producer->scales, producer->zeros, q, producer->blocks,
                                producer->k, kp, producer->group, producer->ring + (q - p) * steps * AMX_STEP_WORDS);
        for (int64_t r = 0; r < mp; r += 32) {
            const int both = r + 32 <= mp;
            const uint16_t *a0 = a + r * kp, *a1 = a0 + 16 * kp;
            _tile_zero(0);
            _tile_zero(1);
            if (both) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t s = 0; s < steps; s++) {
                const uint16_t *b = tiles + s * AMX_STEP_WORDS;
                _tile_loadd(4, a0 + s * 32, kp * 2);
                _tile_loadd(6, b, 64);
                _tile_loadd(7, b + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (both) {
                    _tile_loadd(5, a1 + s * 32, kp * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                if (interleaved)
                    for (owed += per_pair; owed >= iterations; owed -= iterations) amx_produce(BITS, producer);
            }
            const int64_t rows0 = m - r < 16 ? m - r : 16, rows1 = m - r - 16 < 16 ? m - r - 16 : 16;
            amx_store(0, scratch, bias, y, r, rows0, p * 32, n);
            amx_store(1, scratch, bias, y, r, rows0, p * 32 + 16, n);
            if (both && rows1 > 0) {
                amx_store(2, scratch, bias, y, r + 16, rows1, p * 32, n);
                amx_store(3, scratch, bias, y, r + 16, rows1, p * 32 + 16, n);
            }
        }
    }
}

/* Returns 0 (nothing computed) for shapes the layout does not cover or without memory for the tiles. */
int quant_gemm_amx_bf16(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x,
                        const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *y = (uint16_t *)y_;
    const int64_t kp = (k + 31) / 32 * 32, mp = (m + 15) / 16 * 16, steps = kp / 32;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = (blocks + 1) / 2;
    /* A tiles read x in place when its rows are whole 32-wide steps and whole 16-row tiles, else a
     * zero-padded copy */
    const uint16_t *a = (const uint16_t *)x;
    uint16_t *padded = NULL;
    if (kp != k || mp != m) {
        padded = (uint16_t *)calloc((size_t)(mp * kp), sizeof(uint16_t));
        if (padded == NULL) return 0;
        for (int64_t r = 0; r < m; r++) memcpy(padded + r * kp, a + r * k, (size_t)k * sizeof(uint16_t));
        a = padded;
    }
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > pairs ? pairs : num_threads);
    /* interleaved for 8-bit codes and up to 32 rows, panels for 4-bit codes and more (the comment block above) */
    const int interleaved = bits == 8 || mp <= 32;
    int64_t panel = AMX_PANEL_BYTES / (steps * AMX_STEP_WORDS * (int64_t)sizeof(uint16_t));
    if (panel < 2) panel = 2;
    amx_tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* threads take runs of AMX_RUN_PAIRS pairs from a shared counter (as bf16's kernel takes its items), so
         * a thread descheduled on a shared host does not leave the other waiting with half the weight */
        const int64_t slots = interleaved ? 2 : (AMX_RUN_PAIRS < panel ? AMX_RUN_PAIRS : panel);
        uint16_t *ring = (uint16_t *)aligned_alloc(64, (size_t)(slots * steps * AMX_STEP_WORDS) * sizeof(uint16_t));
        float scratch[16 * 16] __attribute__((aligned(64)));
        failed |= ring == NULL;
        if (ring != NULL) _tile_loadconfig(&config);
        const int64_t runs = (pairs + AMX_RUN_PAIRS - 1) / AMX_RUN_PAIRS;
#pragma omp for schedule(dynamic, 1)
        for (int64_t run = 0; run < runs; run++) {
            if (ring == NULL) continue; /* this thread found no memory: the call fails */
            const int64_t first = run * AMX_RUN_PAIRS, last = pairs - first < AMX_RUN_PAIRS ? pairs : first + AMX_RUN_PAIRS;
            amx_producer producer = {(const uint8_t *)weight, (const uint16_t *)scales_, (const uint16_t *)zeros_,
                                     blocks, k, group, steps, ring, first, 0, 0, 0, (last - first) * 2 * steps};
            if (bits == 8)
                amx_pairs(8, a, &producer, interleaved, slots, bias, y, m, mp, n, kp, first, last, scratch);
            else
                amx_pairs(4, a, &producer, interleaved, slots, bias, y, m, mp, n, kp, first, last, scratch);
        }
        if (ring != NULL) _tile_release();
        free(ring);
    }
    free(padded);
    return !failed;
}
#else
int quant_amx_enable(void) { return 0; }
int quant_dequantize_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                              int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)out, (void)n, (void)k, (void)group, (void)num_threads;
    return 0;
}
int quant_gemm_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0; /* no AMX in this build: the caller keeps its other paths */
}
#endif

/* ---- AMX-INT8: the codes themselves as B tiles, the GEMV's integer arithmetic on tiles ------------------
 * y = x W^T (+ bias) for many rows with the GEMV's own arithmetic: x as int16 per x block (prepare_block),
 * D = sum xq * q an exact int32 per x block, then scale * xscale * (D - zero * xsum) accumulated in float over
 * the x blocks in order, the bias added and one rounding. So every output is bitwise quant_gemv_bf16's, an
 * M-row call is bitwise M one-row calls, and a row's result does not depend on how many rows the batch has.
 * AMX-INT8 multiplies bytes: xq = 256 * hi + lo (hi signed, lo unsigned), D = 256 * (hi . q) + (lo . q),
 * two TDPB*D per tile pair, each exact in int32 (|hi . q| <= 128 * 255 * 256 per x block).
 * The 8-bit layout's 64-byte chunk (16 outputs x 4 inputs) is already an AMX-INT8 B tile row, its 4 bytes of
 * output i being inputs 4c + {0, 2, 1, 3}: 16 chunks of a block are a B tile loaded from the weight in place,
 * and x's bytes are permuted the same way. A 4-bit chunk (16 outputs x 8 inputs) gives two tile rows, its low
 * nibbles (inputs 8c + {0, 4, 1, 5}) and high nibbles (8c + {2, 6, 3, 7}), expanded once per call and pair.
 * Against the dequantising kernel above this reads half the bytes (8 bits) and does no per-weight float work:
 * what it adds is the per-row, per-x-block epilogue, so it wins where x blocks are long (per-channel int8,
 * groups of 128) and the rows few enough (see layers/quantization.py's policy). x blocks of 64 inputs and up
 * run 64-input tiles, 32 (groups of 32) half-depth ones. */
#if ISA == 512 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

/* 32 int16 codes of x as the two byte planes A tiles read (hi: signed, lo: unsigned, xq = 256 hi + lo), the
 * inputs permuted within each 8 as the B tile rows hold them (8 bits: {0, 2, 1, 3, 4, 6, 5, 7}; 4 bits:
 * {0, 4, 1, 5, 2, 6, 3, 7}). */
INLINE void split_words(__m512i words, int8_t *hi, uint8_t *lo, int bits) {
    const __m512i order = bits == 8 ? _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                                       15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0)
                                    : _mm512_set_epi16(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21, 17, 20, 16,
                                                       15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
    words = _mm512_permutexvar_epi16(order, words);
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtepi16_epi8(_mm512_srai_epi16(words, 8)));
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtepi16_epi8(_mm512_and_si512(words, _mm512_set1_epi16(0xff))));
}

/* One x block (size a multiple of 32) quantised as prepare_block_512 does, bitwise its codes, scale and sum,
 * written straight as the byte planes (no int16 copy of x: per call a 64-row, 1536-input int16 buffer was
 * an mmap and 48 page faults). A block with a NaN or a magnitude above 3e38 goes to prepare_block. */
static void prepare_split_block(const uint16_t *src, int8_t *hi, uint8_t *lo, int64_t size, int bits, float *xscale,
                                float *xsum) {
    float largest;
    if (!block_largest(src, size, &largest)) {
        int16_t codes[X_BLOCK_MAX];
        prepare_block(src, codes, size, xscale, xsum);
        for (int64_t i = 0; i < size; i += 32)
            split_words(_mm512_loadu_si512((const void *)(codes + i)), hi + i, lo + i, bits);
        return;
    }
    const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < size; i += 32) {
        const __m512i raw = _mm512_loadu_si512((const void *)(src + i));
        const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, scale));
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(q0, q1));
        split_words(_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q0)), _mm512_cvtepi32_epi16(q1), 1),
                    hi + i, lo + i, bits);
    }
    *xscale = inverse > 0.0f ? largest / 32767.0f : 0.0f;
    *xsum = (float)_mm512_reduce_add_epi32(sum);
}

/* A 4-bit block's codes as AMX-INT8 B tile rows: chunk c -> rows 2c (low nibbles), 2c + 1 (high nibbles). */
static void expand_nibbles(const uint8_t *codes, int64_t chunks, uint8_t *rows) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t c = 0; c < chunks; c++) {
        const __m512i chunk = _mm512_loadu_si512((const void *)(codes + c * CHUNK));
        _mm512_store_si512((void *)(rows + 2 * c * CHUNK), _mm512_and_si512(chunk, low));
        _mm512_store_si512((void *)(rows + (2 * c + 1) * CHUNK), _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low));
    }
}

/* One x block of 16 rows against a pair's B tiles (tiles 6, 7; `both`: the pair's second block exists) into C
 * tiles 0-3 = hi.B0, lo.B0, hi.B1, lo.B1. */
INLINE void int_x_block(const int8_t *hi, const uint8_t *lo, int64_t k, const uint8_t *b0, const uint8_t *b1,
                        int64_t tile_rows, int64_t depth, int64_t steps, int both) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, hi + s * depth, k);
        _tile_loadd(5, lo + s * depth, k);
        _tile_loadd(6, b0 + s * tile_rows * CHUNK, CHUNK);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbuud(1, 5, 6);
        if (both) {
            _tile_loadd(7, b1 + s * tile_rows * CHUNK, CHUNK);
            _tile_dpbsud(2, 4, 7);
            _tile_dpbuud(3, 5, 7);
        }
    }
}

/* C tiles 0-3 to out [4][16][16] int32 */
INLINE void int_store(int both, int32_t *out) {
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    if (both) {
        _tile_stored(2, out + 512, 64);
        _tile_stored(3, out + 768, 64);
    }
}

/* The GEMV's per-x-block update of 16 rows x 16 outputs: acc += (D - zero * xsum) * (scale * xscale). */
INLINE void int_accumulate(const int32_t *d_hi, const int32_t *d_lo, __m512 scale, __m512 zero, const float *xsum,
                           const float *xscale, int64_t x_blocks, int64_t rows, float *acc) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)(d_hi + 16 * r)), 8),
                                           _mm512_load_si512((const void *)(d_lo + 16 * r)));
        const __m512 exact = _mm512_fnmadd_ps(zero, _mm512_set1_ps(xsum[r * x_blocks]), _mm512_cvtepi32_ps(d));
        const __m512 factor = _mm512_mul_ps(scale, _mm512_set1_ps(xscale[r * x_blocks]));
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(exact, factor, _mm512_load_ps(acc + 16 * r)));
    }
}

/* One call's operands. */
typedef struct {
    const Prepared *prep;
    const int8_t *a_hi;
    const uint8_t *a_lo, *codes;
    const uint16_t *scales, *zeros, *bias;
    uint16_t *y;
    int64_t m, n, k, group, blocks, chunks, block_bytes, depth;
    int bits;
} IntCall;

/* One work item: 16 rows (from r0) x pair p x x block xb; its B tiles at b, its accumulators at acc, its
 * products stored to out. */
typedef struct {
    int64_t p, r0, xb;
    const uint8_t *b;
    float *acc;
    int32_t *out;
    int both;
} IntItem;

INLINE void int_issue(const IntCall *c, const IntItem *it) {
    const int64_t x_block = c->prep->x_block;
    const uint8_t *b0 = it->b + it->xb * (x_block / 4) * CHUNK;
    int_x_block(c->a_hi + it->r0 * c->k + it->xb * x_block, c->a_lo + it->r0 * c->k + it->xb * x_block, c->k, b0,
                b0 + c->block_bytes, c->depth / 4, c->depth, x_block / c->depth, it->both);
}

/* The item's stored products into its accumulators. */
static void int_epilogue(const IntCall *c, const IntItem *it) {
    const int64_t x_blocks = c->prep->x_blocks, g = it->xb * c->prep->x_block / c->group, groups = c->k / c->group;
    const int64_t rows = c->m - it->r0 < 16 ? c->m - it->r0 : 16;
    const __m512 midpoint = _mm512_set1_ps(c->bits == 8 ? 128.0f : 8.0f);
    for (int64_t half = 0; half < 1 + it->both; half++) {
        const int64_t at = ((2 * it->p + half) * groups + g) * BLOCK;
        const __m512 scale = fload_f16(c->scales + at), zero = c->zeros != NULL ? fload_f16(c->zeros + at) : midpoint;
        int_accumulate(it->out + half * 512, it->out + half * 512 + 256, scale, zero,
                       c->prep->xsum + it->r0 * x_blocks + it->xb, c->prep->xscale + it->r0 * x_blocks + it->xb,
                       x_blocks, rows, it->acc + half * 256);
    }
}

/* The item's accumulators + bias, rounded once, into y. */
static void int_finish(const IntCall *c, const IntItem *it) {
    const int64_t rows = c->m - it->r0 < 16 ? c->m - it->r0 : 16;
    for (int64_t half = 0; half < 1 + it->both; half++) {
        const int64_t col0 = (2 * it->p + half) * BLOCK, n = c->n;
        const __mmask16 live = n - col0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col0)) - 1u);
        const __m512 add = c->bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, c->bias + col0)), 16))
                                           : _mm512_setzero_ps(); /* the GEMV adds 0.0f without a bias too */
        for (int64_t r = 0; r < rows; r++)
            _mm256_mask_storeu_epi16(c->y + (it->r0 + r) * n + col0, live,
                                     round_bf16_exact(_mm512_add_ps(_mm512_load_ps(it->acc + half * 256 + 16 * r), add)));
    }
}

#define INT_GROUP_PAIRS 4 /* pairs (128 outputs) whose accumulators a thread keeps while the x blocks go by */
#define INT_PANEL_ROWS 64 /* rows per pass over the weight */

/* Rows [r_start, r_start + 16 * tiles) against pairs [g0, g1) (their B tiles at b[p - g0]): x blocks outermost,
 * so an x block's slice of x (64 rows x 256 inputs x 2 planes: 32 KB) stays in L1 while every pair of the group
 * uses it, and each pair's tiles of that x block stay in L1 for every row tile. The epilogue of an item runs
 * after the next item's tile products are issued and before they are stored, so the vector work overlaps
 * the TMUL's and never reads a tile store still in flight (the epilogue right after the store: 3072x576 int8,
 * 64 rows, hot, one thread, 750 us; without any epilogue 399). */
static void int_group(const IntCall *c, const uint8_t *const *b, int64_t g0, int64_t g1, int64_t r_start,
                      int64_t tiles, float *acc, int32_t *scratch) {
    memset(acc, 0, sizeof(float) * 512 * (size_t)((g1 - g0) * tiles));
    IntItem pending = {0};
    int64_t count = 0;
    for (int64_t xb = 0; xb < c->prep->x_blocks; xb++)
        for (int64_t p = g0; p < g1; p++)
            for (int64_t t = 0; t < tiles; t++, count++) {
                const IntItem item = {p, r_start + 16 * t, xb, b[p - g0], acc + ((p - g0) * tiles + t) * 512,
                                      scratch + (count & 1) * 1024, 2 * p + 1 < c->blocks};
                int_issue(c, &item);
                if (count > 0) int_epilogue(c, &pending);
                int_store(item.both, item.out);
                pending = item;
            }
    int_epilogue(c, &pending);
    for (int64_t p = g0; p < g1; p++)
        for (int64_t t = 0; t < tiles; t++) {
            const IntItem item = {p, r_start + 16 * t, 0, NULL, acc + ((p - g0) * tiles + t) * 512, NULL,
                                  2 * p + 1 < c->blocks};
            int_finish(c, &item);
        }
}

/* Returns 0 (nothing computed) for shapes it does not cover (x blocks not a multiple of 32 inputs) or without
 * memory; the caller keeps its other paths. */
int quant_gemm_amx_int8(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x,
                        const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const int64_t x_block = x_block_of(group, bits);
    if (x_block % 32) return 0;
    const int64_t depth = x_block % 64 == 0 ? 64 : 32, mp = (m + 15) / 16 * 16;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = (blocks + 1) / 2, chunks = k / step_of(bits);
    Prepared prep = {0};
    prep.x_block = x_block, prep.x_blocks = k / x_block;
    prep.xscale = (float *)malloc(sizeof(float) * (size_t)(mp * prep.x_blocks));
    prep.xsum = (float *)malloc(sizeof(float) * (size_t)(mp * prep.x_blocks));
    int8_t *a_hi = (int8_t *)aligned_alloc(64, (size_t)(mp * k));
    uint8_t *a_lo = (uint8_t *)aligned_alloc(64, (size_t)(mp * k));
    if (prep.xscale == NULL || prep.xsum == NULL || a_hi == NULL || a_lo == NULL) {
        free(prep.xscale), free(prep.xsum), free(a_hi), free(a_lo);
        return 0;
    }
    /* 4 bits: a pair's expanded tile rows (2 blocks x 2 rows a chunk); 8 bits: read in place */
    const IntCall call = {&prep, a_hi, a_lo, (const uint8_t *)weight, (const uint16_t *)scales_,
                          (const uint16_t *)zeros_, (const uint16_t *)bias_, (uint16_t *)y_, m, n, k, group, blocks,
                          chunks, bits == 8 ? chunks * CHUNK : 2 * chunks * CHUNK, depth, bits};
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > pairs ? pairs : num_threads);
    amx_tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 4; t++) config.rows[t] = 16, config.colsb[t] = 64;                 /* C: 16 x 16 int32 */
    for (int t = 4; t < 6; t++) config.rows[t] = 16, config.colsb[t] = (uint16_t)depth;    /* A: 16 x depth */
    for (int t = 6; t < 8; t++) config.rows[t] = (uint8_t)(depth / 4), config.colsb[t] = 64; /* B: depth/4 x 64 */
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r++) {
            if (r < m) {
                for (int64_t xb = 0; xb < prep.x_blocks; xb++)
                    prepare_split_block((const uint16_t *)x + r * k + xb * x_block, a_hi + r * k + xb * x_block,
                                        a_lo + r * k + xb * x_block, x_block, bits, prep.xscale + r * prep.x_blocks + xb,
                                        prep.xsum + r * prep.x_blocks + xb);
            } else { /* padded rows: zero, never stored */
                memset(a_hi + r * k, 0, (size_t)k), memset(a_lo + r * k, 0, (size_t)k);
                for (int64_t xb = 0; xb < prep.x_blocks; xb++)
                    prep.xscale[r * prep.x_blocks + xb] = 0.0f, prep.xsum[r * prep.x_blocks + xb] = 0.0f;
            }
        }
        int32_t *scratch = (int32_t *)aligned_alloc(64, sizeof(int32_t) * 2048);
        float *acc = (float *)aligned_alloc(64, sizeof(float) * 512 * INT_GROUP_PAIRS * (INT_PANEL_ROWS / 16));
        uint8_t *expanded = bits == 4 ? (uint8_t *)aligned_alloc(64, (size_t)(INT_GROUP_PAIRS * 2 * call.block_bytes))
                                      : NULL;
        const int ok = scratch != NULL && acc != NULL && (bits == 8 || expanded != NULL);
        failed |= !ok;
        if (ok) _tile_loadconfig(&config);
        /* threads take groups of pairs from a shared counter (as bf16's kernel takes its items), so a thread
         * descheduled on a shared host does not leave the other waiting at the end with half the weight */
        const int64_t pair_groups = (pairs + INT_GROUP_PAIRS - 1) / INT_GROUP_PAIRS;
        for (int64_t r_start = 0; r_start < m; r_start += INT_PANEL_ROWS) {
            const int64_t rows = m - r_start < INT_PANEL_ROWS ? m - r_start : INT_PANEL_ROWS;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t group_index = 0; group_index < pair_groups; group_index++) {
                if (!ok) continue; /* this thread found no memory: the call fails */
                const int64_t g0 = group_index * INT_GROUP_PAIRS;
                const int64_t g1 = pairs - g0 < INT_GROUP_PAIRS ? pairs : g0 + INT_GROUP_PAIRS;
                const uint8_t *b[INT_GROUP_PAIRS];
                for (int64_t p = g0; p < g1; p++) {
                    const uint8_t *codes = call.codes + 2 * p * chunks * CHUNK;
                    if (bits == 8) {
                        b[p - g0] = codes;
                        continue;
                    }
                    uint8_t *rows_of = expanded + (p - g0) * 2 * call.block_bytes;
                    expand_nibbles(codes, chunks, rows_of);
                    if (2 * p + 1 < blocks) expand_nibbles(codes + chunks * CHUNK, chunks, rows_of + call.block_bytes);
                    b[p - g0] = rows_of;
                }
                int_group(&call, b, g0, g1, r_start, (rows + 15) / 16, acc, scratch);
            }
        }
        if (ok) _tile_release();
        free(scratch), free(acc), free(expanded);
    }
    free(prep.xscale), free(prep.xsum), free(a_hi), free(a_lo);
    return !failed;
}
#else
int quant_gemm_amx_int8(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0; /* no AMX-INT8 in this build: the caller keeps its other paths */
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
 * pairs of each row at a time, transposed 8 x 8 in registers. The scalar copy it replaces (a store every 32 bytes) and
 * calloc's zeroing were a tenth of the GEMM at 576 outputs (576x1536 at 256 rows: 1.38x oneDNN's time). */
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
