/* The quantised GEMV (quant_gemv_bf16 and its decode-step variants _chain and _share): int16 x blocks against the
 * output-row-interleaved codes, 16 output rows a vector (see quant_simd.h for the layout). */
#include "quant_simd.h"

int quant_kernel_isa(void) { return ISA; }

/* x_block_of for the Python side (QuantKernels.int8_tile_depth), so the rule lives here only. */
int64_t quant_x_block_of(int64_t group, int bits) { return known_bits(bits) ? x_block_of(group, bits) : 0; }

#if ISA
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
 * gemv_tile's. STREAM_AHEAD: 6 KiB, where 4 KiB fell behind when the host's memory was fast. */
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
 * KV pool, the interpreter's working set). An L1 prefetch behind the non-temporal one did no better. */
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
 * the high byte, lo: the low one), so one vpshufb per 64 bytes does it; bitwise x_byte_planes. */
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
 * is bitwise stream_block's. */
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
 * is bitwise stream_block's.
 * An x block of a whole group (4, 8, 16 or 32 chunks: groups of 32 to 256) has its chunk count fixed at compile
 * time, so its loop unrolls with the chains in registers (gcc had kept them in copies, ten vmovdqa a chunk pair),
 * and its group is the x block's index (no 64-bit idiv per x block). */
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
 * instead of on DRAM's latency while its own prefetching gets ahead (4 to 24 KiB did the same). */
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
            /* fixed-size copies, inlined: not a libc memcpy call per 8 or 16 bytes */
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
         * for nothing, STREAM_AHEAD or BYTES_AHEAD bytes a call a thread (up to 13 % of a 576x576 int4 weight). */
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
 * fixed cost. */
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
         * (each ~190 ns from a core of another CCD), and the other threads waited for the preparation. */
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
 * (decode_step.c's one-region decode step): the thread's share of y, x prepared into its own buffers, then its
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
#endif
