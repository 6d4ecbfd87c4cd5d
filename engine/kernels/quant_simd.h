/* Weight-streaming GEMV for grouped integer weights with bfloat16 activations (llmctl's GroupedIntWeight), built by
 * kernels/quant.py from quant_gemv.c, quant_amx.c and quant_bf16.c; this header holds the layout, the x preparation
 * and the ISA mapping they share. An AVX-512 body (AVX512-BW; VNNI where the CPU has it) and an AVX2 + FMA + F16C
 * body share one layout; `quant_kernel_isa()` says which one was compiled (0: none, the engine keeps its torch paths).
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
#ifndef LLMCTL_KERNELS_QUANT_SIMD_H
#define LLMCTL_KERNELS_QUANT_SIMD_H
#include "common.h"

/* A function of this header as the one file it was in had it: static, so each library file compiles its own copy
 * with the same inlining choices. */
#define LOCAL static __attribute__((unused))

#define BLOCK 16      /* output rows per block */
#define CHUNK 64      /* bytes per chunk */
#define X_BLOCK_MAX 256 /* 255 * 32767 * 256 < 2^31: the int32 dot products cannot overflow */
/* Each stream of a tile prefetched this many chunks ahead (4 and 32 did worse). */
#define PREFETCH_CHUNKS 8
#define WIDE_MR 8 /* x rows of the AVX-512 body's wide tiles */

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
LOCAL int64_t x_block_of(int64_t group, int bits) {
    const int64_t step = step_of(bits);
    if (group <= X_BLOCK_MAX) return group;
    for (int64_t size = X_BLOCK_MAX; size >= step; size -= step)
        if (group % size == 0 && size % step == 0) return size;
    return 0;
}


/* Whether the layout covers this shape (the Python side checks first and explains). */
LOCAL int covered(int bits, int64_t n, int64_t k, int64_t group) {
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
LOCAL void prepare_block(const uint16_t *src, int16_t *dst, int64_t size, float *xscale, float *xsum) {
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
 * magnitude above 3e38 (where the scalar rules for NaN and infinities decide) goes to prepare_block (the scalar
 * loops were most of a small GEMV's fixed cost). */
LOCAL void prepare_block_512(const uint16_t *src, int16_t *dst, int64_t size, float *xscale, float *xsum) {
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

LOCAL int prepare_alloc(int64_t m, int64_t k, int64_t x_block, Prepared *p) {
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
LOCAL void prepare_rows(const uint16_t *x, int64_t first, int64_t last, int64_t k, const Prepared *p) {
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
 * f32_to_bf16's rounding; the scalar loop took ~10 % of the bf16 GEMM's time). */
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


#if ISA == 512
#define WIDE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) /* WIDE_MR of them */
#endif
#endif
#endif
