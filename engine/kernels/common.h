/* Shared by llmctl's two native kernel libraries (kernels/build.py compiles each from its .c files with the host's
 * C compiler, -O3 -march=native -fopenmp, and binds them with ctypes): ISA guards, bf16 conversions, AMX set-up,
 * and the typed descriptors of the native decode step (kernels/decode_stack.py mirrors them as ctypes Structures;
 * tests/test_native_decode_step.py checks the two layouts against decode_stack_layout()). Plain C11, no torch
 * headers. OpenMP: torch already loaded libgomp (SONAME libgomp.so.1), so the libraries share its thread pool;
 * callers pass the thread count. */
#ifndef LLMCTL_KERNELS_COMMON_H
#define LLMCTL_KERNELS_COMMON_H

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define HIDDEN __attribute__((visibility("hidden"))) /* shared between one library's files, not exported */

/* ---- ISA guards: what the compiler targets (-march=native or a test's -march) ---- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif
#if HAVE_AVX512_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_BF16 1
#else
#define HAVE_AMX_BF16 0
#endif
#if HAVE_AMX_BF16 && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#else
#define HAVE_AMX_INT8 0
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ---- bf16 scalars ---- */
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

/* ---- bf16 and float32 vectors of 16 lanes (AVX-512) ---- */
#if HAVE_AVX512
/* Float32 lanes rounded to bfloat16 precision (nearest even, NaN kept), still as float32: the torch path rounds
 * after every bf16 op, and the fused kernels round where it does to give its results. */
INLINE __m512 round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                             _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

INLINE __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

/* Up to sixteen bf16 (or float) values at `src` + `offset`, widened to float32 (masked lanes 0). `bf16` is a
 * constant at every call, so each element type gets its own code from one always-inlined body. */
INLINE __m512 load16m(const void *src, int64_t offset, __mmask16 live, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, (const uint16_t *)src + offset)), 16));
    return _mm512_maskz_loadu_ps(live, (const float *)src + offset);
}

INLINE __m512 load16(const void *src, int64_t offset, const int bf16) { return load16m(src, offset, 0xffff, bf16); }

INLINE void store16m(void *dst, int64_t offset, __m512 values, __mmask16 live, const int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)dst + offset, live, values);
        return;
    }
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(values)), 16);
    _mm256_mask_storeu_epi16((uint16_t *)dst + offset, live, _mm512_cvtepi32_epi16(high));
}

INLINE void store16(void *dst, int64_t offset, __m512 values, const int bf16) { store16m(dst, offset, values, 0xffff, bf16); }

/* What the torch path stores after one op: bf16-rounded in bf16 mode, unchanged in float32. */
INLINE __m512 as_stored(__m512 x, const int bf16) { return bf16 ? round_bf16(x) : x; }
#endif

/* ---- AMX: the tile state and the tile configuration, for every AMX kernel of both libraries ---- */
#if HAVE_AMX_BF16
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */

/* Linux hands AMX's 8 KiB tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 when granted. The permission is the process's, for all its threads, never taken back. */
INLINE int amx_request_tiles(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Whether this process holds the tile state (ARCH_GET_XCOMP_PERM): the loaders ask for it before any call. */
INLINE int amx_tiles_granted(void) {
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, 0x1022, &features) == 0 && ((features >> 18) & 1);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* One 32-input step of a 32 x 32 bf16 item, for both libraries' AMX GEMMs: A tiles 4 (x rows 0-15 at a0) and 5
 * (rows 16-31 at a1, where `both`), `a_stride` bytes a row, times B tiles 6 and 7 (a 32-output pair's two tiles of
 * 16 input pairs at b and b + 512) into C tiles 0-1 and 2-3. */
INLINE void tile_step_32x32(const uint16_t *a0, const uint16_t *a1, const uint16_t *b, int64_t a_stride, int both) {
    _tile_loadd(4, a0, a_stride);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (both) {
        _tile_loadd(5, a1, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Tiles [first, first + count) of `config` (palette 1) as `rows` rows of `bytes` bytes. */
INLINE void tile_shape(TileConfig *config, int first, int count, int rows, int bytes) {
    config->palette = 1;
    for (int t = first; t < first + count; t++) config->rows[t] = (uint8_t)rows, config->colsb[t] = (uint16_t)bytes;
}
#endif

/* ---- the native decode step's descriptors (decode_step.c; ctypes mirrors in kernels/decode_stack.py) ---- */

/* The kernel a linear's rows run: gemv_bf16 on the plain weight [N, K]; gemm_amx_bf16 on its pack_amx tiles; the
 * quantised library's GEMV (a separate .so, also built for AVX2, so its functions come with the weight). */
enum { STACK_GEMV, STACK_AMX, STACK_QUANT };

/* quant_gemv_bf16_chain: quant_gemv_bf16, then each thread prefetches the start of its share of `next_*`. */
typedef int (*StackQuantGemv)(const void *codes, const void *scales, const void *zeros, int bits, const void *x,
                              const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group,
                              int num_threads, const void *next_codes, const void *next_scales, const void *next_zeros,
                              int next_bits, int64_t next_n, int64_t next_k, int64_t next_group);
/* quant_gemv_bf16_share: thread `me`'s share (of `threads`) of the same, one row, inside the caller's region. */
typedef int (*StackQuantShare)(const void *codes, const void *scales, const void *zeros, int bits, const void *x,
                               const void *bias, void *y, int64_t n, int64_t k, int64_t group, int me, int threads,
                               const void *next_codes, const void *next_scales, const void *next_zeros, int next_bits,
                               int64_t next_n, int64_t next_k, int64_t next_group);

/* One linear, or one part of a quantised weight in parts (kernels/quant.py KernelParts: runs of rows in different
 * code formats), chained by `next_part` (NULL: the last). Scales, zeros, bits, group and functions are 0 for the
 * bf16 kinds; `rows`: the output rows this descriptor writes. */
typedef struct StackLinear {
    int64_t kind;
    const void *weight; /* bf16 [N, K], pack_amx tiles, or quantised codes */
    const void *scales, *zeros; /* zeros NULL: the midpoint */
    int64_t bits, group;
    StackQuantGemv quant_gemv;
    StackQuantShare quant_share;
    int64_t rows;
    const struct StackLinear *next_part;
} StackLinear;

/* One decoder layer's operands (biases NULL where absent). */
typedef struct {
    const uint16_t *input_norm;
    const StackLinear *qkv;
    const uint16_t *qkv_bias;
    const StackLinear *o;
    const uint16_t *o_bias;
    const uint16_t *post_norm;
    const StackLinear *gate_up;
    const uint16_t *gate_up_bias;
    const StackLinear *down;
    const uint16_t *down_bias;
    uint16_t *k_pool, *v_pool; /* [kv_heads, num_blocks, block_size, head_dim] */
} StackLayer;

/* bfloat16 scratch the caller owns, each for `max_tokens` rows. */
typedef struct {
    uint16_t *hidden, *residual, *normed; /* [hidden] */
    uint16_t *qkv;                        /* [q + 2 kv] */
    uint16_t *attended;                   /* [heads * head_dim] */
    uint16_t *gate_up;                    /* [2 * intermediate] */
    uint16_t *act;                        /* [intermediate] */
    uint16_t *logits;                     /* [vocab] */
    uint16_t *cos, *sin;                  /* [head_dim / 2]: the tokens' RoPE rows */
    uint16_t *last_x, *last_residual;     /* [hidden]: the logits rows' stream */
} StackBuffers;

/* A model bound once: its sizes and operands. */
typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, num_blocks, block_size;
    int64_t window; /* 0: none */
    float eps, scale;
    const StackLayer *layers;
    const StackBuffers *buffers;
    const uint16_t *embedding, *final_norm; /* [vocab, hidden], [hidden] */
    const StackLinear *lm_head;
    const uint16_t *cos_table, *sin_table; /* [positions, head_dim / 2] */
} StackModel;

/* One step: `tokens` new tokens (token, position, slot each [tokens]) in `num_rows` rows as paged_attention takes
 * them (tables [num_rows, table_width], lens, and starts/qlens or NULL for one token a row), and the rows whose
 * logits are wanted (logits_rows [num_logits]). */
typedef struct {
    int64_t tokens;
    const int64_t *token, *position, *slot;
    int64_t num_rows;
    const int64_t *tables;
    int64_t table_width;
    const int64_t *lens, *starts, *qlens;
    int64_t num_logits;
    const int64_t *logits_rows;
} StackStep;

#endif
