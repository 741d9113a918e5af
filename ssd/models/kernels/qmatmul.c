/* Row-invariant matrix products on GGUF k-quant weights (Q4_K, Q6_K), for CPUs.
 *
 * Why: llama.cpp's CPU kernels make a forward of n tokens cost about (n + 1) / 2
 * single-token forwards, so a speculative verification pays for almost every
 * drafted token. At one to sixteen rows a forward is bound by reading the
 * weights, so here each weight block is read and unpacked once per call and used
 * for every row of the call.
 *
 * Exactness: a row's output depends on that row alone. Activations are quantized
 * per row (8 bits, one scale per 256 values, as llama.cpp's Q8_K); the products
 * within a group of 16 weights are an exact integer sum; the float steps per row
 * are the same operations in the same order whatever the number of rows, on
 * every instruction set (lane by lane, then the 16 lanes summed in a fixed tree);
 * threads split output channels, never a sum. So a row's logits are
 * bit-identical alone and beside any other rows, and the AVX512-VNNI, AVX2 and
 * portable paths agree bit for bit.
 *
 * Math, per output channel and block of 256 inputs, with 16 groups g of 16
 * weights, integer quants q, the row's int8 activations a (scale sa) and their
 * group sums bsum_g:
 *   sum_i w_i x_i = sa * sum_g [ ds_g * sum_{i in g} q_i a_i  -  dm_g * bsum_g ]
 *   Q4_K (q in 0..15):  ds_g = d * sc[g / 2],   dm_g = dmin * m[g / 2]
 *   Q6_K (q in 0..63):  ds_g = d * sc[g],       dm_g = 32 * d * sc[g]
 * (ds_g and dm_g are exact in fp32: an fp16 times a small integer.)
 *
 *   Q5_0, Q8_0 (per 32 weights j: fp16 d_j, q - 16 or q in int8):
 *                       ds_g = d_{g/2},  dm_g = 16 or 128 * d_{g/2}   (q stored + 16 or + 128)
 *
 * Layout (ssd.models.kernels.qlinear repacks the GGUF blocks once, losslessly):
 * weight (group g, byte b of 16) sits in vector j = b / 4 (64 bytes), lane g,
 * byte b % 4, so one u8 x s8 dot instruction (4 bytes per 32-bit lane) sums
 * four weights of each group into that group's lane. The activations are laid
 * out the same way when quantized, block by block: block b of row r at (b * rows + r) * 256, so one
 * block's rows sit side by side. Quants: 128 bytes whose low nibbles are
 * vectors 0 (bytes 0..63) and 2 (64..127) and high nibbles vectors 1 and 3;
 * Q6_K adds 64 bytes whose bits 2j..2j+1 are vector j's bits 4-5.
 *   Q4_K block, 148 bytes: fp16 d, fp16 dmin, u8 sc[8], u8 m[8], quants[128]
 *   Q6_K block, 210 bytes: fp16 d, i8 sc[16], quants[128], high[64]
 *   Q5_0 block of 256, 176 bytes: fp16 d[8], quants[128], high[32] (bit i of bytes 8j..8j+7: byte i
 *   of vector j's bit 4)
 *   Q8_0 block of 256, 272 bytes: fp16 d[8], then the 4 vectors as whole bytes
 * (inputs not in whole blocks of 256 are padded with zero-scale blocks and zero inputs).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
#define GROUPS 16

enum { FMT_Q4K = 0, FMT_Q6K = 1, FMT_Q5_0 = 2, FMT_Q8_0 = 3 };

/* Q5_0 and Q8_0 keep one fp16 scale per 32 weights; their quants are stored unsigned (q + 16 as
   GGUF stores Q5_0's, q + 128 for Q8_0's int8) and offset back through dm. Q8_0 as whole bytes. */
static inline int per32(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q8_0; }
static inline int is_bytes(int fmt) { return fmt == FMT_Q8_0; }
static inline float byte_offset(int fmt) { return fmt == FMT_Q5_0 ? 16.0f : 128.0f; }
int ssd_block_bytes(int fmt) { return fmt == FMT_Q4K ? 148 : fmt == FMT_Q6K ? 210 : fmt == FMT_Q5_0 ? 176 : 272; }
static inline int quants_offset(int fmt) { return fmt == FMT_Q4K ? 20 : fmt == FMT_Q6K ? 18 : 16; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            int e = -1;
            do { ++e; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A block's per-group factors ds_g, dm_g (see the math above). */
static void block_factors(int fmt, const uint8_t *blk, float *ds, float *dm) {
    uint16_t dh, mh;
    memcpy(&dh, blk, 2);
    float d = half_to_float(dh);
    if (per32(fmt)) {
        for (int g = 0; g < GROUPS; ++g) {
            memcpy(&dh, blk + 2 * (g / 2), 2);
            ds[g] = half_to_float(dh);
            dm[g] = byte_offset(fmt) * ds[g];
        }
    } else if (fmt == FMT_Q4K) {
        memcpy(&mh, blk + 2, 2);
        float dmin = half_to_float(mh);
        for (int g = 0; g < GROUPS; ++g) {
            ds[g] = d * (float)blk[4 + g / 2];
            dm[g] = dmin * (float)blk[12 + g / 2];
        }
    } else {
        const int8_t *sc = (const int8_t *)(blk + 2);
        for (int g = 0; g < GROUPS; ++g) {
            ds[g] = d * (float)sc[g];
            dm[g] = 32.0f * ds[g];
        }
    }
}

typedef struct {
    const uint8_t *weights;
    int fmt;
    int64_t blocks; /* per channel */
    const int8_t *q;      /* [rows, blocks * 256], laid out as the weights */
    const float *scale;   /* [rows, blocks] */
    const float *bsum;    /* [rows, blocks, 16] */
    int64_t rows, channels;
    float *out;
    int64_t out_stride; /* floats between rows of out */
} Job;

enum { ROW_TILE = 16 };
/* A row's activations per block: 256 int8, 16 float group sums, a float scale. */
enum { ROW_BLOCK_BYTES = QK + 4 * GROUPS + 4 };
/* Rows' activations read from L1 (48 KB on current x86 cores): whole when they fit in L1_FIT bytes,
   else in spans of about SPAN_BYTES, so the weights streaming past leave them there. */
enum { L1_FIT = 36000, SPAN_BYTES = 20000 };

/* The 16 lanes' sum in a fixed tree order (halves added lane by lane, four times), as the vector
   paths compute it with shuffles. */
static inline float sum_lanes(const float *lanes) {
    float v[GROUPS];
    memcpy(v, lanes, sizeof v);
    for (int width = GROUPS / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) v[i] = v[i] + v[i + width];
    return v[0];
}

/* Per row and block, lane g: acc_g = fma(fmsub(isum_g, ds_g, bsum_g * dm_g), sa, acc_g). */

static void channels_portable(const Job *job, int64_t c0, int64_t c1, int64_t r0, int64_t tile) {
    const int64_t stride = ssd_block_bytes(job->fmt);
    uint8_t w[QK]; /* in the vector layout: w[64 j + 4 g + b] */
    float ds[GROUPS], dm[GROUPS], acc[ROW_TILE][GROUPS];
    for (int64_t c = c0; c < c1; ++c) {
        memset(acc, 0, sizeof acc);
        for (int64_t b = 0; b < job->blocks; ++b) {
            const uint8_t *blk = job->weights + (c * job->blocks + b) * stride;
            const uint8_t *quants = blk + quants_offset(job->fmt);
            if (is_bytes(job->fmt)) memcpy(w, quants, QK);
            else for (int i = 0; i < 64; ++i) {
                w[i] = quants[i] & 0xF;
                w[64 + i] = quants[i] >> 4;
                w[128 + i] = quants[64 + i] & 0xF;
                w[192 + i] = quants[64 + i] >> 4;
                if (job->fmt == FMT_Q6K)
                    for (int j = 0; j < 4; ++j) w[64 * j + i] |= ((quants[128 + i] >> (2 * j)) & 3) << 4;
                if (job->fmt == FMT_Q5_0)
                    for (int j = 0; j < 4; ++j) w[64 * j + i] |= ((quants[128 + 8 * j + i / 8] >> (i % 8)) & 1) << 4;
            }
            block_factors(job->fmt, blk, ds, dm);
            for (int64_t r = 0; r < tile; ++r) {
                const int8_t *a = job->q + (b * job->rows + r0 + r) * QK;
                const float *bsum = job->bsum + (b * job->rows + r0 + r) * GROUPS;
                float sa = job->scale[b * job->rows + r0 + r];
                for (int g = 0; g < GROUPS; ++g) {
                    int32_t isum = 0;
                    for (int j = 0; j < 4; ++j)
                        for (int k = 0; k < 4; ++k) isum += (int32_t)w[64 * j + 4 * g + k] * a[64 * j + 4 * g + k];
                    float lane = fmaf((float)isum, ds[g], -(bsum[g] * dm[g]));
                    acc[r][g] = fmaf(lane, sa, acc[r][g]);
                }
            }
        }
        for (int64_t r = 0; r < tile; ++r) job->out[(r0 + r) * job->out_stride + c] = sum_lanes(acc[r]);
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

/* block_factors with vector conversions (the scalar loop cost more than the block's dot products):
   16 integer scales and 16 offsets, one per group, times d and dmin. Same values, exactly. */
AVX2 static inline void factors_avx2(int fmt, const uint8_t *blk, __m256 *ds, __m256 *dm) {
    if (per32(fmt)) { /* d_j for groups 2j, 2j + 1 */
        __m128i halves = _mm_loadu_si128((const __m128i *)blk);
        __m128i lo = _mm_unpacklo_epi16(halves, halves), hi = _mm_unpackhi_epi16(halves, halves);
        ds[0] = _mm256_cvtph_ps(lo);
        ds[1] = _mm256_cvtph_ps(hi);
        __m256 off = _mm256_set1_ps(byte_offset(fmt));
        dm[0] = _mm256_mul_ps(off, ds[0]);
        dm[1] = _mm256_mul_ps(off, ds[1]);
        return;
    }
    uint16_t halves[2];
    memcpy(halves, blk, 4);
    __m256 d = _mm256_set1_ps(_cvtsh_ss(halves[0]));
    if (fmt == FMT_Q4K) {
        __m256 dmin = _mm256_set1_ps(_cvtsh_ss(halves[1]));
        __m128i sc = _mm_loadl_epi64((const __m128i *)(blk + 4)), m = _mm_loadl_epi64((const __m128i *)(blk + 12));
        sc = _mm_unpacklo_epi8(sc, sc); /* group g takes sc[g / 2] */
        m = _mm_unpacklo_epi8(m, m);
        for (int h = 0; h < 2; ++h) {
            ds[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8 * h))));
            dm[h] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8 * h))));
        }
    } else {
        __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 2));
        for (int h = 0; h < 2; ++h) {
            ds[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8 * h))));
            dm[h] = _mm256_mul_ps(_mm256_set1_ps(32.0f), ds[h]);
        }
    }
}

/* 32 bits (little-endian) -> 32 bytes, 0x10 where the bit is set (Q5_0's bit 4). */
AVX2 static inline __m256i bits_to_bytes_avx2(const uint8_t *src) {
    uint32_t word;
    memcpy(&word, src, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word), spread);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* AVX2: each 64-byte vector as two 32-byte halves (groups 0-7, 8-15); u8 x s8 pairs in int16
   (no saturation: q <= 63, |a| <= 127), then pairs summed to int32 lanes with a multiply by 1. */
AVX2 static void channels_avx2(const Job *job, int64_t c0, int64_t c1, int64_t r0, int64_t tile) {
    const int64_t stride = ssd_block_bytes(job->fmt);
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE][2];
    for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = 0; r < tile; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < job->blocks; ++b) {
            const uint8_t *blk = job->weights + (c * job->blocks + b) * stride;
            const uint8_t *quants = blk + quants_offset(job->fmt);
            __m256i w[4][2];
            if (is_bytes(job->fmt))
                for (int j = 0; j < 4; ++j)
                    for (int h = 0; h < 2; ++h) w[j][h] = _mm256_loadu_si256((const __m256i *)(quants + 64 * j + 32 * h));
            else for (int h = 0; h < 2; ++h)
                for (int part = 0; part < 2; ++part) { /* bytes 64 part + 32 h: vectors 2 part, 2 part + 1 */
                    __m256i nib = _mm256_loadu_si256((const __m256i *)(quants + 64 * part + 32 * h));
                    __m256i lo = _mm256_and_si256(nib, low4), hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4);
                    if (job->fmt == FMT_Q6K) {
                        __m256i bits = _mm256_loadu_si256((const __m256i *)(quants + 128 + 32 * h));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 4 * part), low2), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 4 * part + 2), low2), 4));
                    }
                    if (job->fmt == FMT_Q5_0) {
                        lo = _mm256_or_si256(lo, bits_to_bytes_avx2(quants + 128 + 8 * (2 * part) + 4 * h));
                        hi = _mm256_or_si256(hi, bits_to_bytes_avx2(quants + 128 + 8 * (2 * part + 1) + 4 * h));
                    }
                    w[2 * part][h] = lo;
                    w[2 * part + 1][h] = hi;
                }
            __m256 vds[2], vdm[2];
            factors_avx2(job->fmt, blk, vds, vdm);
            for (int64_t r = 0; r < tile; ++r) {
                const int8_t *a = job->q + (b * job->rows + r0 + r) * QK;
                const float *bsum = job->bsum + (b * job->rows + r0 + r) * GROUPS;
                __m256 sa = _mm256_set1_ps(job->scale[b * job->rows + r0 + r]);
                for (int h = 0; h < 2; ++h) {
                    __m256i isum = _mm256_setzero_si256();
                    for (int j = 0; j < 4; ++j) {
                        __m256i av = _mm256_loadu_si256((const __m256i *)(a + 64 * j + 32 * h));
                        if (job->fmt == FMT_Q8_0) { /* q + 128 <= 255: a pair of products can pass int16 */
                            __m256i wl = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w[j][h]));
                            __m256i wh = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w[j][h], 1));
                            __m256i al = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(av));
                            __m256i ah = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(av, 1));
                            /* int32 lane i sums bytes 2i, 2i + 1: regroup to 4-byte lanes with hadd */
                            __m256i pl = _mm256_madd_epi16(wl, al), ph = _mm256_madd_epi16(wh, ah);
                            __m256i quads = _mm256_hadd_epi32(pl, ph); /* lanes: l0 l1 h0 h1 | l2 l3 h2 h3 */
                            isum = _mm256_add_epi32(isum, _mm256_permutevar8x32_epi32(quads, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)));
                        } else
                            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j][h], av), ones));
                    }
                    __m256 off = _mm256_mul_ps(_mm256_loadu_ps(bsum + 8 * h), vdm[h]);
                    __m256 lane = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum), vds[h], off);
                    acc[r][h] = _mm256_fmadd_ps(lane, sa, acc[r][h]);
                }
            }
        }
        for (int64_t r = 0; r < tile; ++r) {
            float lanes[GROUPS];
            _mm256_storeu_ps(lanes, acc[r][0]);
            _mm256_storeu_ps(lanes + 8, acc[r][1]);
            job->out[(r0 + r) * job->out_stride + c] = sum_lanes(lanes);
        }
    }
}

/* AVX512-VNNI: one vpdpbusd per 64 weights and row sums 4 products into each group's lane. */
/* `tile` is a constant in each inlined copy (channels_vnni's switch), so the row loops unroll and
   every row's accumulator stays in a register across the blocks. */
/* factors_avx2 in one 16-lane vector each: the same products, so the same bits. */
VNNI static inline __attribute__((always_inline)) void factors_vnni(const int fmt, const uint8_t *blk, __m512 *ds, __m512 *dm) {
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7); /* group g: entry g / 2 */
    if (per32(fmt)) {
        __m512 d = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
        *ds = _mm512_permutexvar_ps(pairs, d);
        *dm = _mm512_mul_ps(_mm512_set1_ps(byte_offset(fmt)), *ds);
        return;
    }
    uint16_t halves[2];
    memcpy(halves, blk, 4);
    __m512 d = _mm512_set1_ps(_cvtsh_ss(halves[0]));
    if (fmt == FMT_Q4K) { /* sc[8] then m[8]: one conversion, then each pair spread over its groups */
        __m512 both = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4))));
        *ds = _mm512_mul_ps(d, _mm512_permutexvar_ps(pairs, both));
        *dm = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(halves[1])),
                            _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), both));
    } else {
        *ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        *dm = _mm512_mul_ps(_mm512_set1_ps(32.0f), *ds);
    }
}

/* sum_lanes' tree: lanes i + 8, then i + 4, i + 2, i + 1. */
VNNI static inline float sum_lanes_vnni(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

VNNI static inline __attribute__((always_inline)) void vnni_rows(const Job *job, int64_t c0, int64_t c1, int64_t r0,
                                                                 const int tile, const int fmt) {
    const int64_t stride = ssd_block_bytes(fmt), rows = job->rows;
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(3);
    __m512 acc[ROW_TILE];
    /* The rows' activations for a span of blocks stay in L1 while 16 channels read them: a long
       input (the FFN's down projection at 8 rows) is taken a span at a time, each channel's lanes
       parked in between. The same operations in the same order per lane, so the same bits. */
    const int64_t most = tile * ROW_BLOCK_BYTES * job->blocks <= L1_FIT ? job->blocks
                       : SPAN_BYTES / (tile * ROW_BLOCK_BYTES) > 1 ? SPAN_BYTES / (tile * ROW_BLOCK_BYTES) : 1;
    const int64_t spans = (job->blocks + most - 1) / most, span = (job->blocks + spans - 1) / spans;
    __m512 parked[16][ROW_TILE];
    for (int64_t cbase = c0; cbase < c1; cbase += 16)
    for (int64_t b0 = 0; b0 < job->blocks; b0 += span) {
    const int64_t b1 = b0 + span < job->blocks ? b0 + span : job->blocks, cend = cbase + 16 < c1 ? cbase + 16 : c1;
    for (int64_t c = cbase; c < cend; ++c) {
#pragma GCC unroll 16
        for (int r = 0; r < tile; ++r) acc[r] = b0 ? parked[c - cbase][r] : _mm512_setzero_ps();
        const uint8_t *blk = job->weights + (c * job->blocks + b0) * stride;
        if (span < job->blocks && c + 1 < cend) /* the next channel's span: strided, so no prefetcher sees it */
            for (int64_t off = 0; off < (b1 - b0) * stride; off += 64)
                _mm_prefetch((const char *)blk + job->blocks * stride + off, _MM_HINT_T0);
        /* this block's rows sit side by side: row r at a constant offset from one pointer */
        const int8_t *a = job->q + (b0 * rows + r0) * QK;
        const float *bsum = job->bsum + (b0 * rows + r0) * GROUPS, *scale = job->scale + b0 * rows + r0;
        for (int64_t b = b0; b < b1; ++b, blk += stride, a += rows * QK, bsum += rows * GROUPS, scale += rows) {
            const uint8_t *quants = blk + quants_offset(fmt);
            __m512i w[4];
            if (is_bytes(fmt))
                for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512(quants + 64 * j);
            else for (int part = 0; part < 2; ++part) {
                __m512i nib = _mm512_loadu_si512(quants + 64 * part);
                __m512i lo = _mm512_and_si512(nib, low4), hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4);
                if (fmt == FMT_Q6K) {
                    __m512i bits = _mm512_loadu_si512(quants + 128);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(bits, 4 * part), low2), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(bits, 4 * part + 2), low2), 4));
                }
                if (fmt == FMT_Q5_0) { /* a mask register per vector: 64 bits, one per byte */
                    uint64_t lo_bits, hi_bits;
                    memcpy(&lo_bits, quants + 128 + 16 * part, 8);
                    memcpy(&hi_bits, quants + 136 + 16 * part, 8);
                    lo = _mm512_or_si512(lo, _mm512_maskz_set1_epi8(lo_bits, 0x10));
                    hi = _mm512_or_si512(hi, _mm512_maskz_set1_epi8(hi_bits, 0x10));
                }
                w[2 * part] = lo;
                w[2 * part + 1] = hi;
            }
            __m512 vds, vdm;
            factors_vnni(fmt, blk, &vds, &vdm);
#pragma GCC unroll 16
            for (int r = 0; r < tile; ++r) {
                const int8_t *ar = a + r * QK;
                __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(ar));
                isum = _mm512_dpbusd_epi32(isum, w[1], _mm512_loadu_si512(ar + 64));
                isum = _mm512_dpbusd_epi32(isum, w[2], _mm512_loadu_si512(ar + 128));
                isum = _mm512_dpbusd_epi32(isum, w[3], _mm512_loadu_si512(ar + 192));
                __m512 off = _mm512_mul_ps(_mm512_loadu_ps(bsum + r * GROUPS), vdm);
                __m512 lane = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), vds, off);
                acc[r] = _mm512_fmadd_ps(lane, _mm512_set1_ps(scale[r]), acc[r]);
            }
        }
        if (b1 < job->blocks)
            for (int r = 0; r < tile; ++r) parked[c - cbase][r] = acc[r];
        else
            for (int r = 0; r < tile; ++r) job->out[(r0 + r) * job->out_stride + c] = sum_lanes_vnni(acc[r]);
    }
    }
}

#define VNNI_TILE(n, f) case n: vnni_rows(job, c0, c1, r0, n, f); break;
#define VNNI_FMT(f) VNNI static void channels_vnni_##f(const Job *job, int64_t c0, int64_t c1, int64_t r0, int64_t tile) { \
    switch (tile) { \
        VNNI_TILE(1, f) VNNI_TILE(2, f) VNNI_TILE(3, f) VNNI_TILE(4, f) VNNI_TILE(5, f) VNNI_TILE(6, f) VNNI_TILE(7, f) \
        VNNI_TILE(8, f) VNNI_TILE(9, f) VNNI_TILE(10, f) VNNI_TILE(11, f) VNNI_TILE(12, f) VNNI_TILE(13, f) \
        VNNI_TILE(14, f) VNNI_TILE(15, f) default: vnni_rows(job, c0, c1, r0, 16, f); \
    } \
}
VNNI_FMT(0) VNNI_FMT(1) VNNI_FMT(2) VNNI_FMT(3)
VNNI static void channels_vnni(const Job *job, int64_t c0, int64_t c1, int64_t r0, int64_t tile) {
    switch (job->fmt) {
        case FMT_Q4K: channels_vnni_0(job, c0, c1, r0, tile); break;
        case FMT_Q6K: channels_vnni_1(job, c0, c1, r0, tile); break;
        case FMT_Q5_0: channels_vnni_2(job, c0, c1, r0, tile); break;
        default: channels_vnni_3(job, c0, c1, r0, tile);
    }
}
#endif

typedef void (*Channels)(const Job *job, int64_t c0, int64_t c1, int64_t r0, int64_t tile);

/* ---- the instruction set, chosen once from the host ---- */

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };
static int chosen_isa = -1;

int ssd_best_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c"))
        return ISA_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

/* Force an instruction set (tests compare them); -1 picks the host's best. Returns the one in use. */
int ssd_set_isa(int isa) {
    int best = ssd_best_isa();
    chosen_isa = (isa < 0 || isa > best) ? best : isa;
    return chosen_isa;
}

/* The instruction set in use (attention.c follows it). */
int ssd_current_isa(void) {
    if (chosen_isa < 0) ssd_set_isa(-1);
    return chosen_isa;
}

static Channels channels_fn(void) {
    if (chosen_isa < 0) ssd_set_isa(-1);
#if defined(__x86_64__) || defined(__i386__)
    if (chosen_isa == ISA_VNNI) return channels_vnni;
    if (chosen_isa == ISA_AVX2) return channels_avx2;
#endif
    return channels_portable;
}

/* ---- activations: per row and 256 values, int8 with one scale, in the weights' layout ---- */

/* One block of 256 values: its scale, its int8 values in the weights' layout, its 16 group sums.
   The same numbers on every path: the peak is a maximum (order-free), each value one product
   rounded to nearest-even, each group sum an integer. */
static void quantize_block_portable(const float *xb, int8_t *qb, float *scale, float *bsum) {
    float peak = 0.0f;
    for (int i = 0; i < QK; ++i) peak = fmaxf(peak, fabsf(xb[i]));
    float inv = peak > 0.0f ? 127.0f / peak : 0.0f;
    *scale = peak / 127.0f;
    for (int g = 0; g < GROUPS; ++g) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) {
            int v = (int)nearbyintf(xb[16 * g + i] * inv); /* |v| <= 127 */
            qb[64 * (i / 4) + 4 * g + i % 4] = (int8_t)v;
            s += v;
        }
        bsum[g] = (float)s;
    }
}

#if defined(__x86_64__) || defined(__i386__)
VNNI static void quantize_block_vnni(const float *xb, int8_t *qb, float *scale, float *bsum) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 top = _mm512_setzero_ps();
    for (int g = 0; g < GROUPS; ++g) top = _mm512_max_ps(top, _mm512_and_ps(_mm512_loadu_ps(xb + 16 * g), magnitude));
    float peak = _mm512_reduce_max_ps(top);
    float inv = peak > 0.0f ? 127.0f / peak : 0.0f;
    *scale = peak / 127.0f;
    uint32_t natural[QK / 4]; /* group g's 16 values as 4 words: word 4 g + j holds values 4 j .. 4 j + 3 */
    for (int g = 0; g < GROUPS; ++g) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), _mm512_set1_ps(inv)));
        bsum[g] = (float)_mm512_reduce_add_epi32(v);
        _mm_storeu_si128((__m128i *)(natural + 4 * g), _mm512_cvtepi32_epi8(v));
    }
    /* vector j holds word j of every group */
    const __m512i words = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
    for (int j = 0; j < 4; ++j)
        _mm512_storeu_si512(qb + 64 * j, _mm512_i32gather_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(j)), natural, 4));
}
#endif

/* ---- a row made ready for the products: optionally RMS-normalised, zero-padded, quantized ----
 *
 * RMSNorm (the layer's input norm, fused so the normalised row never leaves C):
 *   ms = tree16 over lanes l of sum_c x[16 c + l]^2 (fused multiply-adds, c in order), r = 1 / sqrt(ms / n + eps),
 *   y_i = (x_i * r) * w_i.
 * The vector path performs these operations in this order too, so both give the same bits. */

static void norm_portable(const float *x, int64_t cols, const float *weight, float eps, float *y) {
    float lanes[GROUPS] = {0};
    for (int64_t c = 0; c < cols; c += GROUPS)
        for (int l = 0; l < GROUPS; ++l) lanes[l] = fmaf(x[c + l], x[c + l], lanes[l]);
    float r = 1.0f / sqrtf(sum_lanes(lanes) / (float)cols + eps);
    for (int64_t i = 0; i < cols; ++i) y[i] = (x[i] * r) * weight[i];
}

#if defined(__x86_64__) || defined(__i386__)
VNNI static void norm_vnni(const float *x, int64_t cols, const float *weight, float eps, float *y) {
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += GROUPS) {
        __m512 v = _mm512_loadu_ps(x + c);
        lanes = _mm512_fmadd_ps(v, v, lanes);
    }
    float r = 1.0f / sqrtf(sum_lanes_vnni(lanes) / (float)cols + eps);
    __m512 rv = _mm512_set1_ps(r);
    for (int64_t c = 0; c < cols; c += GROUPS)
        _mm512_storeu_ps(y + c, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + c), rv), _mm512_loadu_ps(weight + c)));
}
#endif

/* rows x [rows, cols] (cols a multiple of 16; padded a multiple of 256, >= cols) -> the products'
   activations for `padded` inputs (zeros past cols), after RMSNorm with `weight` (n = cols) where
   weight is not NULL. Returns 0, or -1 when out of memory. */
int ssd_prepare_rows(const float *x, int64_t rows, int64_t cols, int64_t padded, const float *weight, float eps,
                     int8_t *q, float *scale, float *bsum) {
    const int64_t blocks = padded / QK;
    if (chosen_isa < 0) ssd_set_isa(-1);
    const int vector = chosen_isa == ISA_VNNI;
    float *row = malloc(sizeof(float) * (size_t)padded);
    if (row == NULL) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        if (weight != NULL) {
#if defined(__x86_64__) || defined(__i386__)
            if (vector) norm_vnni(xr, cols, weight, eps, row);
            else
#endif
                norm_portable(xr, cols, weight, eps, row);
        } else
            memcpy(row, xr, sizeof(float) * (size_t)cols);
        memset(row + cols, 0, sizeof(float) * (size_t)(padded - cols));
        for (int64_t b = 0; b < blocks; ++b) {
            int8_t *qb = q + (b * rows + r) * QK;
            float *sb = scale + b * rows + r, *gb = bsum + (b * rows + r) * GROUPS;
#if defined(__x86_64__) || defined(__i386__)
            if (vector) {
                quantize_block_vnni(row + b * QK, qb, sb, gb);
                continue;
            }
#endif
            quantize_block_portable(row + b * QK, qb, sb, gb);
        }
    }
    free(row);
    return 0;
}

/* ---- the product: out[r * out_stride + c] = sum_k x[r, k] w[c, k] ---- */

static void run_channels(const Job *job, int64_t c0, int64_t c1) {
    Channels channels = channels_fn();
    for (int64_t r0 = 0; r0 < job->rows; r0 += ROW_TILE)
        channels(job, c0, c1, r0, job->rows - r0 < ROW_TILE ? job->rows - r0 : ROW_TILE);
}

/* ---- threads: torch's own OpenMP pool ----
 *
 * Built with -fopenmp, this library's dependency on libgomp.so.1 resolves to the copy torch has
 * already loaded, so the product runs on torch's OpenMP threads: one pool in the process, whose
 * threads torch's ops and these kernels take in turn (a second pool would spin against it on the
 * same cores). The caller passes its torch thread count. Threads take fixed units of 16 output
 * channels; a channel is always computed whole by one thread, so any split gives the same bits. */

void ssd_matmul(const uint8_t *weights, int fmt, int64_t channels, int64_t cols, const int8_t *q, const float *scale,
                const float *bsum, int64_t rows, float *out, int64_t out_stride, int threads) {
    Job job = {weights, fmt, cols / QK, q, scale, bsum, rows, channels, out, out_stride};
    int64_t units = (channels + 15) / 16;
    if (threads <= 1 || units < 8) {
        run_channels(&job, 0, channels);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int part = 0; part < threads; ++part) {
        int64_t c0 = units * part / threads * 16, c1 = units * (part + 1) / threads * 16;
        run_channels(&job, c0 < channels ? c0 : channels, c1 < channels ? c1 : channels);
    }
}
