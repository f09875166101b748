/* w4a8 on the CPU: y = x @ w.T with w in 4-bit (or 6- or 8-bit) codes and x quantized to int8 per row and
 * superblock of 256 inputs; and, at the end, the attention of a step's few new rows. native.py holds the PyTorch
 * reference that defines w4a8, the packing and the build; read that first.
 *
 * Weight layout, chosen for the dot product: panels of 16 output columns; a panel is superblocks of 8 groups of 32
 * inputs in order (the last maybe fewer); a superblock is 16 f16 d of its columns' scales and 16 of their lows, then
 * its groups; a group is its codes (16 columns x 32 inputs), then 16 int8 q of the scales and 16 of the lows:
 * w[c, k] = d[c] x q[c] x code + dlow[c] x qlow[c], as a GGUF K block's own d x sc and dmin x m (native.py).
 * The codes form 8 vectors of 64 bytes, vector t holding inputs 4t .. 4t + 3 of each column (byte 4c + i), so one
 * vpdpbusd adds four products per column. 8-bit codes are those 8 vectors as they are (512 bytes); 4-bit ones pack
 * vector t in the low nibbles and vector t + 4 in the high nibbles of 4 vectors (256 bytes); 6-bit ones are those 4
 * vectors of low nibbles, then 2 of high bits, vector t's at bits 2 (t / 2) of vector t % 2 (384 bytes).
 * 6-bit codes are a GGUF Q6_K block's own: w[c, k] = d[c] x q[c, half] x (code - 32), a scale per 16 inputs, so
 * their superblock has only the 16 d, their group the 16 q of its first half, then those of its second.
 * Activations: xq int8 in groups of 32, and per row and group dx (its superblock's step) and xs (dx x the sum of
 * its codes), so a group adds scale x dx x sum(code x xq) + low x xs to each column; per half group xo (32 x the sum
 * of its codes), so a 6-bit half adds scale x dx x (sum(code x xq) - xo). A superblock's groups share dx (as
 * llama.cpp's Q8_K), so a row's scaled sums gather over the superblock and dx multiplies them once, at its end.
 * Group-major: a group's rows side by side, so a tile finds each row's at a constant offset from one pointer.
 * Speed: a tile of a panel's rows keeps its int32 sums and float accumulators in registers; each group's codes are
 * read and unpacked once for the tile's rows; the rows' sums are independent chains, interleaved; a thread reads
 * its panels one after another (one stream); for tiles of several rows, software prefetch runs ahead of it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GROUP 32
#define PANEL 16
#define SUPER 8 /* groups a superblock */
#define PREFETCH 4096 /* bytes ahead in a panel's stream: the hardware prefetchers stop at page ends */
#define BLOCK_BYTES (8 << 20) /* a block of a long prompt's quantized rows: well within a last-level cache */

static int group_bytes(int bits) { return bits * PANEL * GROUP / 8 + 2 * PANEL; }
static int head_bytes(int bits) { return bits == 6 ? 2 * PANEL : 4 * PANEL; }
static int64_t panel_bytes_of(int bits, int64_t groups) {
    return (groups + SUPER - 1) / SUPER * head_bytes(bits) + groups * group_bytes(bits);
}
/* group g of a panel, and the head of its superblock */
static inline const uint8_t *group_at(const uint8_t *panel, int64_t g, int bits) {
    return panel + (g / SUPER + 1) * head_bytes(bits) + g * group_bytes(bits);
}
static inline const uint8_t *head_at(const uint8_t *panel, int64_t g, int bits) {
    return panel + g / SUPER * (head_bytes(bits) + SUPER * group_bytes(bits));
}

static inline float half_to_float(uint16_t h) { /* IEEE binary16 -> float, subnormals included */
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    int exponent = (h >> 10) & 31;
    uint32_t mantissa = h & 1023;
    float value = exponent == 0 ? ldexpf((float)mantissa, -24) : ldexpf((float)(mantissa | 1024), exponent - 25);
    if (exponent == 31) value = mantissa ? NAN : INFINITY;
    uint32_t bits;
    memcpy(&bits, &value, 4);
    bits |= sign;
    memcpy(&value, &bits, 4);
    return value;
}

/* exp(x) for x <= 0 to a float's precision, in plain arithmetic the compiler vectorises (not libm's expf, nor fmaxf
 * or floorf, which keep gcc's loops scalar): x = k ln 2 + r, k rounded to nearest by adding and taking away 1.5 x 2^23,
 * |r| <= ln 2 / 2, e^r by its degree-6 Taylor-like polynomial (Cephes' coefficients), times 2^k. Below -87 (-inf
 * included: a masked score, a restricted logit) exactly 0: e^-87 is a float's smallest normal */
static inline float exp_nonpositive(float v) {
    float x = v < -87.0f ? -87.0f : v;
    float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return v < -87.0f ? 0.0f : p * scale;
}

/* ------------------------------------------------------------ activations: int8 per row and superblock of 256 */
/* the largest |v| of a group of 32 */
static inline float group_amax(const float *v) {
    float amax = 0;
    #pragma omp simd reduction(max : amax)
    for (int i = 0; i < GROUP; i++) { /* not fmaxf: a libm call each, the loop scalar */
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* a group of 32 in its superblock's step: codes q, dx = step, xs = step x the sum of the codes, xo = 32 x the sum of
 * each 16 */
static inline void quantize_group(const float *v, float step, int8_t *q, float *dx, float *xs, int32_t *xo) {
    int sum[2] = {0, 0};
    for (int i = 0; i < GROUP; i++) {
        int code = step > 0 ? (int)nearbyintf(v[i] / step) : 0; /* round half to even, as torch.round */
        q[i] = (int8_t)code;
        sum[i / 16] += code;
    }
    *dx = step;
    *xs = step * (float)(sum[0] + sum[1]);
    xo[0] = 32 * sum[0];
    xo[1] = 32 * sum[1];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static void quantize_group_avx512(const float *v, float step, int8_t *q, float *dx, float *xs, int32_t *xo) {
    if (step == 0) {
        memset(q, 0, GROUP);
        *dx = 0;
        *xs = 0;
        xo[0] = 0;
        xo[1] = 0;
        return;
    }
    __m512 divisor = _mm512_set1_ps(step);
    __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(v), divisor));
    __m512i qb = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(v + 16), divisor));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
    int sum_a = _mm512_reduce_add_epi32(qa);
    int sum_b = _mm512_reduce_add_epi32(qb);
    *dx = step;
    *xs = step * (float)(sum_a + sum_b);
    xo[0] = 32 * sum_a;
    xo[1] = 32 * sum_b;
}
#define QUANTIZE_GROUP quantize_group_avx512
#else
#define QUANTIZE_GROUP quantize_group
#endif

/* where group g of rows x in inputs, counted row by row, sits group-major (a group's rows side by side) */
static inline int64_t group_major(int64_t g, int64_t in, int64_t rows) {
    return g % (in / GROUP) * rows + g / (in / GROUP);
}

/* the superblocks of a row of in inputs: SUPER groups each, the last maybe fewer */
static inline int64_t superblocks(int64_t in) { return (in / GROUP + SUPER - 1) / SUPER; }

/* the groups of superblock `task` of rows x in inputs (counted row by row): the first group's number, and their
 * count */
static inline int64_t superblock_groups(int64_t task, int64_t in, int64_t *first) {
    int64_t per_row = in / GROUP;
    int64_t supers = superblocks(in);
    int64_t start = task % supers * SUPER;
    *first = task / supers * per_row + start;
    return per_row - start < SUPER ? per_row - start : SUPER;
}

/* groups v[0 .. count) of one superblock in its step, the largest |v| of them / 127, group-major from group first */
static void quantize_superblock(const float *const *v, int64_t count, int64_t first, int64_t in, int64_t rows,
                                int8_t *xq, float *dx, float *xs, int32_t *xo) {
    float amax = 0;
    for (int64_t i = 0; i < count; i++) {
        float a = group_amax(v[i]);
        amax = a > amax ? a : amax;
    }
    float step = amax / 127;
    for (int64_t i = 0; i < count; i++) {
        int64_t at = group_major(first + i, in, rows);
        QUANTIZE_GROUP(v[i], step, xq + at * GROUP, dx + at, xs + at, xo + 2 * at);
    }
}

/* linear's first half on its own, for the tests that hold it to the reference exactly: group-major, as linear's
 * (a group's rows side by side: xq [in / 32, rows, 32], dx and xs [in / 32, rows], xo [in / 32, rows, 2]) */
void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *xq, float *dx, float *xs, int32_t *xo,
                   int threads) {
    int64_t tasks = rows * superblocks(in);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tasks >= 128)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t first;
        int64_t count = superblock_groups(task, in, &first);
        const float *v[SUPER];
        for (int64_t i = 0; i < count; i++) v[i] = x + (first + i) * GROUP;
        quantize_superblock(v, count, first, in, rows, xq, dx, xs, xo);
    }
}

/* ------------------------------------------------------------ one panel x a tile of rows */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KERNEL_ISA "avx512_vnni"
#define MAX_TILE 12 /* rows of a one-panel tile: a sum and an accumulator a row, and the codes, in 32 registers */
/* 6-bit codes' high two bits, at bits 2j of each byte of v, moved to bits 4 and 5 (16-bit shifts: the bits that
 * cross into a neighbouring byte are masked off) */
static inline __attribute__((always_inline)) __m512i high_bits_avx512(const uint8_t *v, int j) {
    __m512i h = _mm512_loadu_si512(v);
    if (j < 2) h = _mm512_slli_epi16(h, 4 - 2 * j);
    if (j == 3) h = _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(h, _mm512_set1_epi8(0x30));
}

/* sum + the dot products of codes' unsigned bytes with the 4 signed bytes at a, in each 32-bit lane: vpdpbusd taking
 * a broadcast from memory, as EVEX allows (gcc broadcasts into a register first, one more instruction a product) */
static inline __attribute__((always_inline)) __m512i dot_broadcast(__m512i sum, __m512i codes, const int32_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(codes), "m"(*a));
    return sum;
}

/* 16 int8 -> 16 floats */
static inline __attribute__((always_inline)) __m512 int8_floats_avx512(const uint8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

/* 16 f16 -> 16 floats */
static inline __attribute__((always_inline)) __m512 half_floats_avx512(const uint8_t *h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int bits, int64_t groups,
        const int8_t *xq, const float *dx, const float *xs, const int32_t *xo, int64_t ld, int rows, float *y,
        int64_t out) {
    __m512 acc[MAX_TILE];
    __m512 part[MAX_TILE]; /* the superblock's scaled sums so far: its rows' steps multiply them once, at its end */
    #pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int r = 0; r < rows; r++) part[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15);
    int gb = group_bytes(bits);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = group_at(panel, g, bits);
        const uint8_t *head = head_at(panel, g, bits);
        const int8_t *xg = xq + g * ld * GROUP; /* the group's rows side by side: their offsets are constants */
        const float *dxg = dx + g * ld;
        const float *xsg = xs + g * ld;
        const int32_t *xog = xo + 2 * g * ld;
        __m512i s[MAX_TILE];
        #pragma GCC unroll 16
        for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        if (rows > 1) { /* one row: the hardware prefetchers keep up alone, faster */
            #pragma GCC unroll 9
            for (int line = 0; line < gb; line += 64) _mm_prefetch((const char *)p + PREFETCH + line, _MM_HINT_T0);
        }
        /* inputs 4t .. 4t + 3 of every row in turn: the rows' sums are independent chains, interleaved here */
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            int t = i;
            if (bits == 4) t = i / 2 + 4 * (i % 2); /* t and t + 4 come from one vector */
            __m512i codes;
            if (bits == 8) codes = _mm512_loadu_si512(p + 64 * t);
            else if (t < 4) codes = _mm512_and_si512(_mm512_loadu_si512(p + 64 * t), nibble);
            else codes = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + 64 * (t - 4)), 4), nibble);
            if (bits == 6) codes = _mm512_or_si512(codes, high_bits_avx512(p + 256 + 64 * (t % 2), t / 2));
            #pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                s[r] = dot_broadcast(s[r], codes, (const int32_t *)(xg + r * GROUP) + t);
            }
            if (bits == 6 && i % 4 == 3) { /* a half group's 16 inputs summed: times its scale, then summed anew */
                __m512 scale = _mm512_mul_ps(half_floats_avx512(head), int8_floats_avx512(p + 384 + 16 * (i / 4)));
                #pragma GCC unroll 16
                for (int r = 0; r < rows; r++) {
                    __m512i offset = _mm512_set1_epi32(xog[2 * r + i / 4]);
                    __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r], offset));
                    part[r] = _mm512_fmadd_ps(sum, scale, part[r]);
                    s[r] = _mm512_setzero_si512();
                }
            }
        }
        if (bits != 6) {
            const uint8_t *f = p + bits * PANEL * GROUP / 8;
            __m512 scale = _mm512_mul_ps(half_floats_avx512(head), int8_floats_avx512(f));
            __m512 low = _mm512_mul_ps(half_floats_avx512(head + 32), int8_floats_avx512(f + 16));
            #pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scale, part[r]);
                acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsg[r]), acc[r]);
            }
        }
        if (g % SUPER == SUPER - 1 || g == groups - 1) { /* the superblock's end: times each row's step */
            #pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                acc[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(dxg[r]), acc[r]);
                part[r] = _mm512_setzero_ps();
            }
        }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * out, acc[r]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MAX_TILE 3 /* 16 registers: 3 rows x (2 sums + 2 accumulators) and the codes being used */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KERNEL_ISA "avx512_vnni_256"
#define DOT(sum, u, s) _mm256_dpbusd_epi32(sum, u, s)
#elif defined(__AVXVNNI__)
#define KERNEL_ISA "avx_vnni"
#define DOT(sum, u, s) _mm256_dpbusd_avx_epi32(sum, u, s)
#else
#define KERNEL_ISA "avx2"
/* four u8 x s8 products a lane summed into its int32: pairs into int16 (4-bit codes cannot saturate), then pairs */
#define DOT(sum, u, s) _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

static inline __attribute__((always_inline)) __m256i dot_codes(__m256i sum, __m256i codes, __m256i x, int bits) {
    if (bits < 8) return DOT(sum, codes, x); /* 6-bit codes times int8 cannot saturate maddubs' int16 pairs either */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    return DOT(sum, codes, x);
#else
    /* 8-bit codes would saturate maddubs' int16 pairs: their two nibbles apart, the high one's sum times 16 */
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i high = DOT(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble), x);
    return DOT(_mm256_add_epi32(sum, _mm256_slli_epi32(high, 4)), _mm256_and_si256(codes, nibble), x);
#endif
}

/* 8 int8 -> 8 floats */
static inline __attribute__((always_inline)) __m256 int8_floats_avx2(const uint8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* high_bits_avx512's, in 256 bits */
static inline __attribute__((always_inline)) __m256i high_bits_avx2(const uint8_t *v, int j) {
    __m256i h = _mm256_loadu_si256((const __m256i *)v);
    if (j < 2) h = _mm256_slli_epi16(h, 4 - 2 * j);
    if (j == 3) h = _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(h, _mm256_set1_epi8(0x30));
}

static inline __attribute__((always_inline)) void panel_tile(const uint8_t *panel, int bits, int64_t groups,
        const int8_t *xq, const float *dx, const float *xs, const int32_t *xo, int64_t ld, int rows, float *y,
        int64_t out) {
    __m256 acc[MAX_TILE][2];
    #pragma GCC unroll 3
    for (int r = 0; r < rows; r++) {
        acc[r][0] = _mm256_setzero_ps();
        acc[r][1] = _mm256_setzero_ps();
    }
    const __m256i nibble = _mm256_set1_epi8(15);
    int gb = group_bytes(bits);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = group_at(panel, g, bits);
        const uint8_t *head = head_at(panel, g, bits);
        const int8_t *xg = xq + g * ld * GROUP;
        const float *dxg = dx + g * ld;
        const float *xsg = xs + g * ld;
        const int32_t *xog = xo + 2 * g * ld;
        for (int line = 0; line < gb; line += 64) _mm_prefetch((const char *)p + PREFETCH + line, _MM_HINT_T0);
        __m256i s[MAX_TILE][2];
        #pragma GCC unroll 3
        for (int r = 0; r < rows; r++) {
            s[r][0] = _mm256_setzero_si256();
            s[r][1] = _mm256_setzero_si256();
        }
        #pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) { /* columns 0-7, then 8-15 */
                __m256i codes;
                if (bits == 8) codes = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h));
                else codes = _mm256_loadu_si256((const __m256i *)(p + 64 * (t % 4) + 32 * h));
                if (bits < 8) codes = _mm256_and_si256(t < 4 ? codes : _mm256_srli_epi16(codes, 4), nibble);
                if (bits == 6) codes = _mm256_or_si256(codes, high_bits_avx2(p + 256 + 64 * (t % 2) + 32 * h, t / 2));
                #pragma GCC unroll 3
                for (int r = 0; r < rows; r++) {
                    const int32_t *a = (const int32_t *)(xg + r * GROUP);
                    s[r][h] = dot_codes(s[r][h], codes, _mm256_set1_epi32(a[t]), bits);
                }
                if (bits == 6 && t % 4 == 3) { /* a half group's 16 inputs summed: times its scale, then anew */
                    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h)));
                    __m256 scale = _mm256_mul_ps(d, int8_floats_avx2(p + 384 + 16 * (t / 4) + 8 * h));
                    #pragma GCC unroll 3
                    for (int r = 0; r < rows; r++) {
                        __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(dxg[r]));
                        __m256i offset = _mm256_set1_epi32(xog[2 * r + t / 4]);
                        __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[r][h], offset));
                        acc[r][h] = _mm256_fmadd_ps(sum, step, acc[r][h]);
                        s[r][h] = _mm256_setzero_si256();
                    }
                }
            }
        }
        const uint8_t *f = p + bits * PANEL * GROUP / 8;
        #pragma GCC unroll 2
        for (int h = 0; h < 2 && bits != 6; h++) {
            __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h))),
                                         int8_floats_avx2(f + 8 * h));
            __m256 low = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32 + 16 * h))),
                                       int8_floats_avx2(f + 16 + 8 * h));
            #pragma GCC unroll 3
            for (int r = 0; r < rows; r++) {
                __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(dxg[r]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), step, acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(xsg[r]), acc[r][h]);
            }
        }
    }
    #pragma GCC unroll 3
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * out, acc[r][0]);
        _mm256_storeu_ps(y + r * out + 8, acc[r][1]);
    }
}

#else
#define KERNEL_ISA "portable"
#define MAX_TILE 1

static void panel_tile(const uint8_t *panel, int bits, int64_t groups, const int8_t *xq, const float *dx,
        const float *xs, const int32_t *xo, int64_t ld, int rows, float *y, int64_t out) {
    (void)rows; /* one row a tile */
    for (int c = 0; c < PANEL; c++) {
        float acc = 0;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p = group_at(panel, g, bits);
            const uint8_t *f = p + bits * PANEL * GROUP / 8;
            const uint8_t *head = head_at(panel, g, bits);
            int32_t s[2] = {0, 0}; /* the group's halves: 6-bit codes have a scale each */
            for (int k = 0; k < GROUP; k++) {
                int t = k / 4;
                int at = 4 * c + k % 4;
                int code;
                if (bits == 8) code = p[64 * t + at];
                else code = (p[64 * (t % 4) + at] >> (4 * (t / 4))) & 15;
                if (bits == 6) code |= (p[256 + 64 * (t % 2) + at] >> (2 * (t / 2)) & 3) << 4;
                s[k / 16] += code * xq[g * ld * GROUP + k];
            }
            uint16_t d;
            uint16_t dlow;
            memcpy(&d, head + 2 * c, 2);
            memcpy(&dlow, head + 32 + 2 * c, 2);
            const int8_t *q = (const int8_t *)f;
            if (bits == 6) {
                acc = fmaf((float)(s[0] - xo[2 * g * ld]), half_to_float(d) * q[c] * dx[g * ld], acc);
                acc = fmaf((float)(s[1] - xo[2 * g * ld + 1]), half_to_float(d) * q[16 + c] * dx[g * ld], acc);
            } else {
                acc = fmaf((float)(s[0] + s[1]), half_to_float(d) * q[c] * dx[g * ld], acc);
                acc = fmaf(half_to_float(dlow) * q[16 + c], xs[g * ld], acc);
            }
        }
        y[c] = acc;
    }
    (void)out;
}
#endif

/* A tile of each row count and code width, so that every loop over them unrolls into registers. */
#define TILE(n) case n: \
    if (bits == 4) panel_tile(panel, 4, groups, xq, dx, xs, xo, ld, n, y, out); \
    else if (bits == 6) panel_tile(panel, 6, groups, xq, dx, xs, xo, ld, n, y, out); \
    else panel_tile(panel, 8, groups, xq, dx, xs, xo, ld, n, y, out); \
    break;

static void panel_rows(const uint8_t *panel, int bits, int64_t groups, const int8_t *xq, const float *dx,
        const float *xs, const int32_t *xo, int64_t ld, int rows, float *y, int64_t out) {
    switch (rows) {
        TILE(1)
#if MAX_TILE >= 3
        TILE(2) TILE(3)
#endif
#if MAX_TILE >= 12
        TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif
    }
}

/* ------------------------------------------------------------ inputs kept out of the rounding */
/* A few input channels whose activations are far larger than the rest (a model's massive activations) would set
 * their groups' steps and round the other 31 inputs to a step or two: at[n] (ascending) are kept out of the
 * rounding and multiply w's own columns there, w [n, out] float32. */
struct outliers {
    const int32_t *at;
    const float *w;
    int64_t n;
};

/* group v (inputs first .. first + 31 of a row) with its outlier inputs moved to aside[j] and zeroed: in prepared
 * where it holds one (v itself is the caller's) */
static const float *set_aside(const float *v, float *prepared, int64_t first, const struct outliers *o, float *aside) {
    for (int64_t j = 0; j < o->n; j++) {
        int64_t i = o->at[j] - first;
        if (i < 0 || i >= GROUP) continue;
        if (v != prepared) memcpy(prepared, v, GROUP * sizeof(float));
        v = prepared;
        aside[j] = prepared[i];
        prepared[i] = 0;
    }
    return v;
}

/* a panel's tile y [rows, PANEL] (rows ldy apart) += aside [rows, o->n] @ o->w's PANEL columns from `column` (o->w's
 * rows ldy long): the outlier inputs' part, in float32, while the tile is in cache */
static void add_outliers(float *y, int64_t ldy, int64_t rows, const float *aside, const struct outliers *o,
                         int64_t column) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < o->n; j++) {
            float a = aside[r * o->n + j];
            const float *w = o->w + j * ldy + column;
            #pragma omp simd
            for (int i = 0; i < PANEL; i++) y[r * ldy + i] += a * w[i];
        }
    }
}

/* y [rows, out] float32 (rows ldy apart) = x @ w.T, x given as quantize_rows' (xq, dx, xs, xo) and its outlier
 * inputs aside (o's, w's columns from `column` of o->w): the calling thread's share of the panels in a parallel
 * region, with no barrier after it. A panel at a time, its tiles of rows in turn: one stream of weights a thread,
 * which the hardware prefetchers follow best. A long prompt's rows go in blocks whose activations the last-level
 * cache holds while every panel passes over them (else each panel would read them all from memory again). */
static void matmul_share(const uint8_t *w, int bits, int64_t out, int64_t in, const int8_t *xq, const float *dx,
                         const float *xs, const int32_t *xo, const float *aside, const struct outliers *o,
                         int64_t column, int64_t rows, float *y, int64_t ldy) {
    int64_t groups = in / GROUP;
    int64_t panel_bytes = panel_bytes_of(bits, groups);
    int64_t block = BLOCK_BYTES / (in + 16 * groups) / MAX_TILE * MAX_TILE; /* a row's xq, dx, xs and xo */
    if (block < MAX_TILE) block = MAX_TILE;
    for (int64_t start = 0; start < rows; start += block) {
        int64_t count = rows - start < block ? rows - start : block;
        int64_t tiles = (count + MAX_TILE - 1) / MAX_TILE;
        #pragma omp for schedule(static) nowait
        for (int64_t c = 0; c < out / PANEL; c++) {
            for (int64_t t = 0; t < tiles; t++) {
                int64_t first = start + count * t / tiles; /* tiles of balanced size: 16 rows are 8 + 8, not 12 + 4 */
                int64_t n = start + count * (t + 1) / tiles - first;
                float *tile = y + first * ldy + c * PANEL;
                panel_rows(w + c * panel_bytes, bits, groups, xq + first * GROUP, dx + first, xs + first,
                           xo + 2 * first, rows, (int)n, tile, ldy);
                if (o->n) add_outliers(tile, ldy, n, aside + first * o->n, o, column + c * PANEL);
            }
        }
    }
}

/* ------------------------------------------------------------ equal rows multiplied once */
#define DISTINCT_ROWS 64 /* rows up to which a call looks for equal ones: a step's rows, not a prompt's */

/* rows a and b of group-major activations (ld rows) quantized alike: the same codes and steps, and outlier inputs
 * aside [ld, n] */
static int same_row(const int8_t *xq, const float *dx, const float *aside, int64_t n, int64_t ld, int64_t groups,
                    int64_t a, int64_t b) {
    if (memcmp(aside + a * n, aside + b * n, n * sizeof(float))) return 0;
    for (int64_t g = 0; g < groups; g++) {
        if (dx[g * ld + a] != dx[g * ld + b]) return 0;
        if (memcmp(xq + (g * ld + a) * GROUP, xq + (g * ld + b) * GROUP, GROUP)) return 0;
    }
    return 1;
}

/* A row's result is its own input's, so rows quantized alike (a particle's copies after resampling, and their
 * equal drafts) need one multiply: the distinct rows move to the front of the group-major activations (ld becomes
 * their count) and of aside [rows, n], slot[r] = the distinct row whose result row r takes; -> their count. */
static int64_t gather_distinct(int8_t *xq, float *dx, float *xs, int32_t *xo, float *aside, int64_t n, int64_t rows,
                               int64_t groups, int32_t *slot) {
    int64_t first[DISTINCT_ROWS]; /* each distinct row's first occurrence */
    int64_t distinct = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t u = 0;
        while (u < distinct && !same_row(xq, dx, aside, n, rows, groups, first[u], r)) u++;
        if (u == distinct) first[distinct++] = r;
        slot[r] = (int32_t)u;
    }
    if (distinct == rows) return rows;
    for (int64_t u = 0; u < distinct; u++) memmove(aside + u * n, aside + first[u] * n, n * sizeof(float));
    for (int64_t g = 0; g < groups; g++) { /* in order: a row only ever moves down, onto one already moved */
        for (int64_t u = 0; u < distinct; u++) {
            int64_t from = g * rows + first[u];
            int64_t to = g * distinct + u;
            memmove(xq + to * GROUP, xq + from * GROUP, GROUP);
            dx[to] = dx[from];
            xs[to] = xs[from];
            xo[2 * to] = xo[2 * from];
            xo[2 * to + 1] = xo[2 * from + 1];
        }
    }
    return distinct;
}

/* y [rows, out] from its distinct rows' results at its front: row r becomes row slot[r] (slot[r] <= r, so from the
 * last row up nothing is overwritten before it is read); the calling thread's share of the columns */
static void spread_rows(float *y, int64_t rows, int64_t out, const int32_t *slot) {
    #pragma omp for schedule(static)
    for (int64_t c = 0; c < out; c += PANEL) {
        for (int64_t r = rows - 1; r > 0; r--) {
            if (slot[r] != r) memcpy(y + r * out + c, y + slot[r] * out + c, PANEL * sizeof(float));
        }
    }
}

/* silu(gate) x up for a group of 32 of each: SwiGLU's input to the down projection. silu(v) = v / (1 + e^-v), with
 * e = e^-|v| (at most 1, so exp_nonpositive's): 1 / (1 + e) for v >= 0, e / (1 + e) below */
static inline void swiglu_group(const float *gate, const float *up, float *v) {
    #pragma omp simd
    for (int i = 0; i < GROUP; i++) {
        float e = exp_nonpositive(-fabsf(gate[i]));
        float sigmoid = (gate[i] >= 0 ? 1.0f : e) / (1.0f + e);
        v[i] = gate[i] * sigmoid * up[i];
    }
}

/* RoPE on the first `rotated` heads (head_dim wide) of each row of y, in place: y[j] cos[j] + y[(j + D / 2) % D]
 * sin[j], with cos, sin [rows, D] in model.rope_tables' half-split layout (sin's first half negated) */
static void rotate_heads(float *y, int64_t rows, int64_t out, const float *cos, const float *sin, int64_t rotated,
                         int64_t D) {
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < rows * rotated; task++) {
        int64_t r = task / rotated;
        float *head = y + r * out + task % rotated * D;
        const float *c = cos + r * D;
        const float *s = sin + r * D;
        for (int64_t j = 0; j < D / 2; j++) {
            float first = head[j];
            float second = head[j + D / 2];
            head[j] = first * c[j] + second * s[j];
            head[j + D / 2] = second * c[j + D / 2] + first * s[j + D / 2];
        }
    }
}

/* y [rows, out] float32 = x [rows, in] float32 @ W.T (+ bias [out] unless NULL), W's first `head` rows in w, of
 * `bits` bits, the rest in tail, of tail_bits (a fused q/k/v whose v the file holds wider; tail NULL: none). With
 * norm [in] (else NULL), x's rows RMS-normalised first, times norm: x / sqrt(mean(x^2) + eps) x norm. gated: x is
 * [rows, 2 in], gate then up, and the input is silu(gate) x up (not with norm). With cos and sin [rows, head_dim]
 * (else NULL), the first `rotated` heads of y rotated after the bias (RoPE). The rows are quantized into scratch
 * (rows x in bytes, then 2 x rows x in / 32 floats, as many int32, rows floats, rows + 1 int32, rows x o->n
 * floats), then multiplied, rows quantized alike (and alike in o's outlier inputs, added in float32) once: the
 * calling thread's share, in a parallel region, all of y written when it returns. */
static void linear_share(const uint8_t *w, int bits, int64_t head, const uint8_t *tail, int tail_bits, int64_t out,
                         int64_t in, const float *x, int64_t rows, float *y, const float *bias, const float *norm,
                         float eps, int gated, const float *cos, const float *sin, int64_t rotated, int64_t head_dim,
                         const struct outliers *o, uint8_t *scratch) {
    int64_t groups = rows * (in / GROUP);
    int8_t *xq = (int8_t *)scratch;
    float *dx = (float *)(scratch + rows * in);
    float *xs = dx + groups;
    int32_t *xo = (int32_t *)(xs + groups);
    float *inverse_rms = (float *)(xo + 2 * groups);
    int32_t *slot = (int32_t *)(inverse_rms + rows);
    int32_t *distinct = slot + rows;
    float *aside = (float *)(distinct + 1); /* [rows, o->n]: each row's inputs at the outlier channels */
    if (norm) {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            double squares = 0;
            for (int64_t i = 0; i < in; i++) squares += (double)x[r * in + i] * x[r * in + i];
            inverse_rms[r] = 1.0f / sqrtf((float)(squares / in) + eps);
        }
    }
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < rows * superblocks(in); task++) {
        int64_t first;
        int64_t count = superblock_groups(task, in, &first);
        float prepared[SUPER * GROUP];
        const float *v[SUPER];
        for (int64_t i = 0; i < count; i++) { /* each group's input as the matmul takes it */
            int64_t g = first + i;
            float *room = prepared + i * GROUP;
            v[i] = x + g * GROUP;
            if (gated) {
                const float *gate = x + g / (in / GROUP) * 2 * in + g % (in / GROUP) * GROUP;
                swiglu_group(gate, gate + in, room);
                v[i] = room;
            }
            if (norm) {
                const float *n = norm + g % (in / GROUP) * GROUP;
                for (int j = 0; j < GROUP; j++) room[j] = v[i][j] * inverse_rms[g / (in / GROUP)] * n[j];
                v[i] = room;
            }
            if (o->n) v[i] = set_aside(v[i], room, g % (in / GROUP) * GROUP, o, aside + g / (in / GROUP) * o->n);
        }
        quantize_superblock(v, count, first, in, rows, xq, dx, xs, xo);
    }
    int64_t used = rows; /* after the loop's barrier: all quantized */
    if (rows > 1 && rows <= DISTINCT_ROWS) {
        #pragma omp single
        *distinct = (int32_t)gather_distinct(xq, dx, xs, xo, aside, o->n, rows, in / GROUP, slot);
        used = *distinct;
    }
    matmul_share(w, bits, head, in, xq, dx, xs, xo, aside, o, 0, used, y, out);
    if (tail) matmul_share(tail, tail_bits, out - head, in, xq, dx, xs, xo, aside, o, head, used, y + head, out);
    #pragma omp barrier
    if (used < rows) spread_rows(y, rows, out, slot);
    if (bias) {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++) y[r * out + o] += bias[o];
    }
    if (cos) rotate_heads(y, rows, out, cos, sin, rotated, head_dim); /* after the bias loop's barrier */
}

/* linear_share's y, in one parallel region (one start of the threads a call) */
void linear(const uint8_t *w, int bits, int64_t head, const uint8_t *tail, int tail_bits, int64_t out, int64_t in,
            const float *x, int64_t rows, float *y, const float *bias, const float *norm, float eps, int gated,
            const float *cos, const float *sin, int64_t rotated, int64_t head_dim, const int32_t *outliers,
            const float *w_outliers, int64_t n_outliers, uint8_t *scratch, int threads) {
    struct outliers o = {outliers, w_outliers, n_outliers};
    #pragma omp parallel num_threads(threads)
    linear_share(w, bits, head, tail, tail_bits, out, in, x, rows, y, bias, norm, eps, gated, cos, sin, rotated,
                 head_dim, &o, scratch);
}

const char *isa(void) { return KERNEL_ISA; }

/* ------------------------------------------------------------ attention of a few new rows against the cache */
#define KEYS 64 /* keys scored at a time: their scores stay in L1 beside the row's output */

/* One query row against keys [0, n) of k/v [n, D] (those with seen[j] == 0 skipped, where seen is not NULL), folded
 * into its running softmax: m (the largest score so far), l (the sum of exp(score - m)), o [D] (sum of exp x v). */
static inline __attribute__((always_inline)) void fold_keys_of(const float *restrict qrow, const float *restrict k,
        const float *restrict v, int64_t n, const uint8_t *seen, int64_t D, float scale, float *m, float *l,
        float *restrict o) {
    float scores[KEYS];
    for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
        int64_t block = n - j0 < KEYS ? n - j0 : KEYS;
        float top = *m;
        for (int64_t j = 0; j < block; j++) {
            const float *key = k + (j0 + j) * D;
            float dot = 0;
            #pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qrow[d] * key[d];
            scores[j] = seen && !seen[j0 + j] ? -INFINITY : dot * scale;
            top = scores[j] > top ? scores[j] : top; /* not fmaxf, which is slower here */
        }
        if (top == -INFINITY) continue; /* nothing seen yet */
        float rescale = exp_nonpositive(*m - top); /* the earlier sums, to the new largest score */
        *l *= rescale;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] *= rescale;
        #pragma omp simd
        for (int64_t j = 0; j < block; j++) scores[j] = exp_nonpositive(scores[j] - top); /* -inf: 0 */
        for (int64_t j = 0; j < block; j++) {
            const float *value = v + (j0 + j) * D;
            float p = scores[j];
            *l += p;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * value[d];
        }
        *m = top;
    }
}

/* fold_keys_of for the usual head sizes as constants: the loops over D unrolled, o kept in registers over a block */
static void fold_keys(const float *qrow, const float *k, const float *v, int64_t n, const uint8_t *seen, int64_t D,
                      float scale, float *m, float *l, float *o) {
    if (D == 128) fold_keys_of(qrow, k, v, n, seen, 128, scale, m, l, o);
    else if (D == 64) fold_keys_of(qrow, k, v, n, seen, 64, scale, m, l, o);
    else fold_keys_of(qrow, k, v, n, seen, D, scale, m, l, o);
}

/* out [R, N, T, Hq, D] for q [R, N, T, Hq, D] (its rows ldq floats apart), prefix_k/v [R, Hkv, P_cap, D],
 * suffix_k/v [R, N, Hkv, S_cap, D], all float32 and contiguous; prefix_len, suffix_len int32 [R]; tree uint8 [R, T, T]
 * or NULL (causal): kernels.py's particle_attention_ref. Each (request, particle, query row) is one task: its prefix,
 * committed suffix and the new keys it sees, one running softmax. The calling thread's share, in a parallel region. */
static void attention_share(const float *q, int64_t ldq, const float *prefix_k, const float *prefix_v,
                            const float *suffix_k, const float *suffix_v, const int32_t *prefix_len,
                            const int32_t *suffix_len, const uint8_t *tree, float scale, int64_t R, int64_t N,
                            int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t P_cap, int64_t S_cap, float *out) {
    int64_t G = Hq / Hkv;
    int64_t tasks = R * N * T * Hq;
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t hq = task % Hq;
        int64_t t = task / Hq % T;
        int64_t n = task / (Hq * T) % N;
        int64_t r = task / (Hq * T * N);
        int64_t h = hq / G;
        const float *qrow = q + task / Hq * ldq + hq * D;
        float *o = out + task * D;
        float m = -INFINITY;
        float l = 0;
        for (int64_t d = 0; d < D; d++) o[d] = 0;
        const float *pk = prefix_k + (r * Hkv + h) * P_cap * D;
        const float *pv = prefix_v + (r * Hkv + h) * P_cap * D;
        fold_keys(qrow, pk, pv, prefix_len[r], NULL, D, scale, &m, &l, o);
        const float *sk = suffix_k + ((r * N + n) * Hkv + h) * S_cap * D;
        const float *sv = suffix_v + ((r * N + n) * Hkv + h) * S_cap * D;
        int64_t committed = suffix_len[r];
        if (tree) { /* the committed keys, then the new ones the tree lets it see */
            fold_keys(qrow, sk, sv, committed, NULL, D, scale, &m, &l, o);
            fold_keys(qrow, sk + committed * D, sv + committed * D, T, tree + (r * T + t) * T, D, scale, &m, &l, o);
        } else {
            fold_keys(qrow, sk, sv, committed + t + 1, NULL, D, scale, &m, &l, o);
        }
        float inverse = 1.0f / l;
        for (int64_t d = 0; d < D; d++) o[d] *= inverse;
    }
}

/* attention_share's out for contiguous q, in one parallel region where there is a task for each thread */
void particle_attention(const float *q, const float *prefix_k, const float *prefix_v, const float *suffix_k,
                        const float *suffix_v, const int32_t *prefix_len, const int32_t *suffix_len,
                        const uint8_t *tree, float scale, int64_t R, int64_t N, int64_t T, int64_t Hq, int64_t Hkv,
                        int64_t D, int64_t P_cap, int64_t S_cap, float *out, int threads) {
    #pragma omp parallel num_threads(threads) if (R * N * T * Hq >= threads)
    attention_share(q, Hq * D, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, tree, scale, R, N, T,
                    Hq, Hkv, D, P_cap, S_cap, out);
}

/* ------------------------------------------------------------ a decoder layer's step in one call */
/* A matmul weight as linear() takes it (bias NULL: none) */
struct matmul {
    const uint8_t *w;
    const uint8_t *tail;
    const float *bias;
    int64_t head;
    int64_t out;
    int64_t in;
    int32_t bits;
    int32_t tail_bits;
    struct outliers outliers;
};

/* A decoder layer's weights: model.Block's */
struct layer {
    struct matmul qkv;
    struct matmul wo;
    struct matmul w13;
    struct matmul w2;
    const float *attn_norm;
    const float *ffn_norm;
    float eps;
    float scale;
    int64_t Hq;
    int64_t Hkv;
    int64_t D;
};

static void matmul_of(const struct matmul *m, const float *x, int64_t rows, float *y, const float *norm, float eps,
                      int gated, const float *cos, const float *sin, int64_t rotated, int64_t D, uint8_t *scratch) {
    linear_share(m->w, m->bits, m->head, m->tail, m->tail_bits, m->out, m->in, x, rows, y, m->bias, norm, eps, gated,
                 cos, sin, rotated, D, &m->outliers, scratch);
}

/* x [rows, n] += part [rows, n]: the residual stream */
static void add_share(float *x, const float *part, int64_t n) {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] += part[i];
}

/* spent[part] += the seconds since *since, by the first thread, after a barrier: every thread's work before it;
 * no clock is read where spent is NULL (nobody asked for the timing) */
static void lap(double *spent, int part, double *since) {
    if (spent == NULL || omp_get_thread_num() != 0) return;
    double now = omp_get_wtime();
    spent[part] += now - *since;
    *since = now;
}

/* model.Block's step for x [R, N, T, dim] (rows = R N T), in place, as its calls compute it one by one (the same
 * arithmetic, the same tokens): x += wo(attention(rope(qkv(norm(x))))), its K/V written at suffix_len + t of this
 * layer's cache; x += w2(swiglu(w13(norm(x)))). cos, sin [rows, D]; work: rows x (qkv out + Hq D + dim + w13 out)
 * floats; scratch: linear's, for the widest input. One parallel region. spent [3] (or NULL: untimed) gains the
 * seconds of its matmuls, of its K/V writes and attention, and of its residual adds. */
void decoder_layer(float *x, int64_t R, int64_t N, int64_t T, const struct layer *l, const float *cos,
                   const float *sin, const float *prefix_k, const float *prefix_v, float *suffix_k, float *suffix_v,
                   const int32_t *prefix_len, const int32_t *suffix_len, const uint8_t *tree, int64_t P_cap,
                   int64_t S_cap, float *work, uint8_t *scratch, double *spent, int threads) {
    int64_t rows = R * N * T;
    int64_t D = l->D;
    int64_t dim = l->wo.out;
    float *qkv = work;                          /* [rows, (Hq + 2 Hkv) D] */
    float *heads = qkv + rows * l->qkv.out;     /* [rows, Hq D] */
    float *part = heads + rows * l->Hq * D;     /* [rows, dim] */
    float *ffn = part + rows * dim;             /* [rows, 2 ffn] */
    #pragma omp parallel num_threads(threads)
    {
        double since = spent ? omp_get_wtime() : 0.0;
        matmul_of(&l->qkv, x, rows, qkv, l->attn_norm, l->eps, 0, cos, sin, l->Hq + l->Hkv, D, scratch);
        lap(spent, 0, &since);
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * l->Hkv; task++) { /* this step's keys and values into the cache */
            int64_t row = task / l->Hkv;
            int64_t h = task % l->Hkv;
            int64_t r = row / (N * T);
            int64_t at = ((row / T * l->Hkv + h) * S_cap + suffix_len[r] + row % T) * D;
            const float *k = qkv + row * l->qkv.out + (l->Hq + h) * D;
            memcpy(suffix_k + at, k, D * sizeof(float));
            memcpy(suffix_v + at, k + l->Hkv * D, D * sizeof(float));
        }
        attention_share(qkv, l->qkv.out, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, tree,
                        l->scale, R, N, T, l->Hq, l->Hkv, D, P_cap, S_cap, heads);
        lap(spent, 1, &since);
        matmul_of(&l->wo, heads, rows, part, NULL, 0, 0, NULL, NULL, 0, 0, scratch);
        lap(spent, 0, &since);
        add_share(x, part, rows * dim);
        lap(spent, 2, &since);
        matmul_of(&l->w13, x, rows, ffn, l->ffn_norm, l->eps, 0, NULL, NULL, 0, 0, scratch);
        matmul_of(&l->w2, ffn, rows, part, NULL, 0, 1, NULL, NULL, 0, 0, scratch);
        lap(spent, 0, &since);
        add_share(x, part, rows * dim);
        lap(spent, 2, &since);
    }
}

/* ------------------------------------------------------------ a token drawn from each row of logits */
#define SAMPLE_CHUNK 256 /* kernels.SAMPLE_CHUNK: the entries a partial sum covers */

/* e^(x / t - top) = e^(x inverse - top) for x of a row whose largest tempered logit is top (0 for -inf) */
static inline float weight_of(float x, float inverse, float top) { return exp_nonpositive(x * inverse - top); }

/* a row's largest logit, and where it first is */
static float row_max(const float *x, int64_t V, int64_t *at) {
    float top = -INFINITY;
    #pragma omp simd reduction(max : top)
    for (int64_t v = 0; v < V; v++) top = x[v] > top ? x[v] : top; /* not fmaxf: it keeps the loop scalar */
    *at = 0;
    while (*at < V - 1 && !(x[*at] == top)) (*at)++;
    return top;
}

/* a sampling call's work, split: each row's largest tempered logit (top), 1 / its temperature (inverse: 1 at 0),
 * where its largest logit first is (first), and its sums a chunk of SAMPLE_CHUNK entries (sums [B, chunks]) */
struct rows_seen {
    float *top;
    float *inverse;
    int64_t *first;
    float *sums;
};

static struct rows_seen rows_seen_in(float *work, int64_t B) {
    struct rows_seen seen;
    seen.top = work;
    seen.inverse = work + B;
    seen.first = (int64_t *)(work + 2 * B);
    seen.sums = work + 4 * B;
    return seen;
}

/* seen's fields for logits [B, V] at temperatures t: the calling thread's share, in a parallel region; the chunks
 * of all rows shared out, so one row keeps every thread busy */
static void chunk_sums(const float *logits, int64_t B, int64_t V, const float *t, const struct rows_seen *seen) {
    int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        seen->inverse[b] = t[b] > 0 ? 1.0f / t[b] : 1.0f;
        seen->top[b] = row_max(logits + b * V, V, seen->first + b) * seen->inverse[b];
    }
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < B * chunks; task++) {
        int64_t b = task / chunks;
        const float *x = logits + b * V;
        int64_t from = task % chunks * SAMPLE_CHUNK;
        int64_t to = from + SAMPLE_CHUNK < V ? from + SAMPLE_CHUNK : V;
        float sum = 0;
        #pragma omp simd reduction(+ : sum)
        for (int64_t v = from; v < to; v++) sum += weight_of(x[v], seen->inverse[b], seen->top[b]);
        seen->sums[task] = sum;
    }
}

/* a row's total weight from its chunks' sums, in double */
static double row_total(const float *sums, int64_t chunks) {
    double total = 0;
    for (int64_t c = 0; c < chunks; c++) total += sums[c];
    return total;
}

/* kernels.sample_ref's draw from row x [V] with uniform u, given its chunks' sums and their total: the first token
 * whose running sum of weights exceeds u x total, found a chunk at a time, then in the chunk drawn entry by entry;
 * where u x total rounds past every sum, the last chunk and entry of nonzero weight; a row of no weight (NaN) draws
 * its last token */
static int64_t draw_row(const float *x, int64_t V, const float *sums, double total, float inverse, float top,
                        float u) {
    int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    double target = u * total;
    int64_t chosen = V - 1;
    double before = 0; /* the sums of the chunks before the one looked at */
    int64_t drawn = -1; /* the chunk drawn (so far: the last of nonzero weight), and the sums before it */
    double before_drawn = 0;
    for (int64_t c = 0; c < chunks && total > 0; c++) {
        if (sums[c] > 0) {
            drawn = c;
            before_drawn = before;
        }
        if (before + sums[c] > target) break;
        before += sums[c];
    }
    if (drawn < 0) return chosen;
    int64_t to = (drawn + 1) * SAMPLE_CHUNK < V ? (drawn + 1) * SAMPLE_CHUNK : V;
    double running = before_drawn;
    for (int64_t v = drawn * SAMPLE_CHUNK; v < to; v++) {
        float w = weight_of(x[v], inverse, top);
        if (w > 0) chosen = v;
        running += w;
        if (running > target) break; /* first true just after a weight > 0 */
    }
    return chosen;
}

/* out [B] = log softmax(logits [B, V] float32 / t[b])[tokens[b]], as kernels.token_logprobs_ref (at t 0: 0 for a
 * largest logit, -inf for any other token); with u [B] (else NULL) tokens are first drawn, row b with uniform u[b],
 * as kernels.sample_ref draws them (at t 0 its first largest logit). work: 4 B + B x chunks floats (rows_seen's) */
void rows_logprobs(const float *logits, int64_t B, int64_t V, const float *t, const float *u, int64_t *tokens,
                   float *out, float *work, int threads) {
    struct rows_seen seen = rows_seen_in(work, B);
    int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    #pragma omp parallel num_threads(threads)
    {
        chunk_sums(logits, B, V, t, &seen);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const float *x = logits + b * V;
            const float *sums = seen.sums + b * chunks;
            double total = row_total(sums, chunks);
            if (u) tokens[b] = seen.first[b];
            if (u && t[b] > 0) tokens[b] = draw_row(x, V, sums, total, seen.inverse[b], seen.top[b], u[b]);
            float picked = x[tokens[b]];
            out[b] = picked * seen.inverse[b] - seen.top[b] - (float)log(total);
            if (!(t[b] > 0)) out[b] = picked >= x[seen.first[b]] ? 0.0f : -INFINITY;
        }
    }
}
