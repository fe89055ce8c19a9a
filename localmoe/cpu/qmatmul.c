/* Packed-weight CPU kernels of localmoe.cpu.qmatmul (its docstring describes the packed
   layouts and the arithmetic).

   Compiled on first use by qmatmul._build() with the system C compiler
   (-O3 -shared -fPIC -ffp-contract=off -fopenmp, plus -mavx2 -mfma -mf16c where the CPU has
   AVX2) into a per-user cache keyed by the sha256 of this text, and loaded with ctypes. The
   argument lists of the exported lm_* functions are declared there (the argtypes in _build)
   and change together with this file. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define AI static inline __attribute__((always_inline))

/* value v (0..31) of a q4 group: v = 8j + l; l < 4: low nibble of byte 4l + j, else high
   nibble of byte 4(l - 4) + j (nibble 2j + l/4 of little-endian word l % 4) */
#define Q4_VAL(qb, v) ((((v) & 7) < 4) ? ((qb)[4 * ((v) & 7) + ((v) >> 3)] & 15) \
                                      : ((qb)[4 * (((v) & 7) - 4) + ((v) >> 3)] >> 4))

/* group sums of x: xs[M, G] = sum of x[m, g*gs .. g*gs+gs) */
static void group_sums(const float *x, int64_t M, int64_t K, int64_t gs, float *xs) {
    int64_t G = K / gs;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < G; g++) {
            float a = 0.f;
            for (int64_t j = 0; j < gs; j++) a += x[i * K + g * gs + j];
            xs[i * G + g] = a;
        }
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
#endif

#define MB 4   /* rows of x per pass over a weight row */

#ifdef __AVX2__
/* the 32 values of a q4 group as 4 x 8 floats (values 8k .. 8k+7 in vector k): both 128-bit
   halves hold the group's 4 words; lane l of vector k takes nibble 2k + l/4 of word l%4, which
   _pack_q4 filled with value 8k + l -- per-lane shifts, no shuffles */
AI void q4_unpack(const uint8_t *qb, __m256 *w) {
    const __m256i mask = _mm256_set1_epi32(15);
    const __m256i sh = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qb));
    __m256i s1 = _mm256_add_epi32(sh, eight), s2 = _mm256_add_epi32(s1, eight);
    __m256i s3 = _mm256_add_epi32(s2, eight);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, sh), mask));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s1), mask));
    w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s2), mask));
    w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s3), mask));
}

AI __m256 cvt8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* dot of one group (gs = 16 or 32 values) of x with w, as 8 partial sums (two short chains) */
AI __m256 gdot(const float *xg, const __m256 *w, const int gs) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xg), w[0]);
    __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xg + 8), w[1]);
    if (gs == 32) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), w[2], a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), w[3], b);
    }
    return _mm256_add_ps(a, b);
}

/* one weight row n against mb (compile-time) rows of x: y[i] = sum_g s_g dot_g + m_g xs[i,g] */
AI void row_tile(const int kind, const int gs, const int mb, const float *x, int64_t K,
                 const void *qn, const float *sn, const float *mn, const float *xs, int64_t G,
                 float *y, int64_t ldy) {
    __m256 acc[MB];
    float macc[MB];
    for (int i = 0; i < mb; i++) { acc[i] = _mm256_setzero_ps(); macc[i] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
        __m256 w[4];
        if (kind == 0) q4_unpack((const uint8_t *)qn + g * 16, w);
        else {
            const int8_t *qb = (const int8_t *)qn + g * gs;
            w[0] = cvt8(qb); w[1] = cvt8(qb + 8);
            if (gs == 32) { w[2] = cvt8(qb + 16); w[3] = cvt8(qb + 24); }
        }
        __m256 sg = _mm256_broadcast_ss(sn + g);
        for (int i = 0; i < mb; i++) {
            acc[i] = _mm256_fmadd_ps(gdot(x + i * K + g * gs, w, gs), sg, acc[i]);
            if (mn) macc[i] += mn[g] * xs[i * G + g];
        }
    }
    for (int i = 0; i < mb; i++) y[i * ldy] = hsum8(acc[i]) + macc[i];
}

/* M == 1: weight rows n and n+1 together (x loaded once per group, two independent chains) */
AI void row2_tile(const int kind, const int gs, const float *x, int64_t K, const void *qa,
                  const void *qb2, const float *sa, const float *sb, const float *ma,
                  const float *mb2, const float *xs, int64_t G, float *y) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float m0 = 0.f, m1 = 0.f;
    for (int64_t g = 0; g < G; g++) {
        __m256 w[4], v[4];
        /* software prefetch ~1 KB ahead in the (adjacent) rows and their scales */
        _mm_prefetch((const char *)qa + g * (kind == 0 ? 16 : gs) + 1024, _MM_HINT_T0);
        if ((g & 7) == 0) {
            _mm_prefetch((const char *)(sa + g) + 512, _MM_HINT_T0);
            if (ma) _mm_prefetch((const char *)(ma + g) + 512, _MM_HINT_T0);
        }
        if (kind == 0) {
            q4_unpack((const uint8_t *)qa + g * 16, w);
            q4_unpack((const uint8_t *)qb2 + g * 16, v);
        } else {
            const int8_t *pa = (const int8_t *)qa + g * gs, *pb = (const int8_t *)qb2 + g * gs;
            w[0] = cvt8(pa); w[1] = cvt8(pa + 8); v[0] = cvt8(pb); v[1] = cvt8(pb + 8);
            if (gs == 32) { w[2] = cvt8(pa + 16); w[3] = cvt8(pa + 24); v[2] = cvt8(pb + 16); v[3] = cvt8(pb + 24); }
        }
        const float *xg = x + g * gs;
        __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        __m256 a = _mm256_mul_ps(x0, w[0]), b = _mm256_mul_ps(x1, w[1]);
        __m256 c = _mm256_mul_ps(x0, v[0]), d = _mm256_mul_ps(x1, v[1]);
        if (gs == 32) {
            __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            a = _mm256_fmadd_ps(x2, w[2], a); b = _mm256_fmadd_ps(x3, w[3], b);
            c = _mm256_fmadd_ps(x2, v[2], c); d = _mm256_fmadd_ps(x3, v[3], d);
        }
        acc0 = _mm256_fmadd_ps(_mm256_add_ps(a, b), _mm256_broadcast_ss(sa + g), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_add_ps(c, d), _mm256_broadcast_ss(sb + g), acc1);
        if (ma) { m0 += ma[g] * xs[g]; m1 += mb2[g] * xs[g]; }
    }
    y[0] = hsum8(acc0) + m0;
    y[1] = hsum8(acc1) + m1;
}

AI void rows_kind(const int kind, const int gs, const float *x, int64_t M, int64_t K,
                  const void *q, const float *s, const float *m, int64_t n0, int64_t n1,
                  float *y, int64_t ldy, const float *xs) {
    const int64_t G = K / gs;
    const int64_t rowb = kind == 0 ? G * 16 : K;
    if (M == 1) {
        for (; n0 + 1 < n1; n0 += 2) {
            const uint8_t *qa = (const uint8_t *)q + n0 * rowb;
            row2_tile(kind, gs, x, K, qa, qa + rowb, s + n0 * G, s + (n0 + 1) * G,
                      m ? m + n0 * G : NULL, m ? m + (n0 + 1) * G : NULL, xs, G, y + n0);
        }
    }
    for (int64_t n = n0; n < n1; n++) {
        const void *qn = (const uint8_t *)q + n * rowb;
        const float *sn = s + n * G, *mn = m ? m + n * G : NULL;
        for (int64_t i0 = 0; i0 < M; i0 += MB) {
            const float *xi = x + i0 * K, *xsi = xs + i0 * G;
            float *yi = y + i0 * ldy + n;
            switch (M - i0 < MB ? M - i0 : MB) {
            case 1: row_tile(kind, gs, 1, xi, K, qn, sn, mn, xsi, G, yi, ldy); break;
            case 2: row_tile(kind, gs, 2, xi, K, qn, sn, mn, xsi, G, yi, ldy); break;
            case 3: row_tile(kind, gs, 3, xi, K, qn, sn, mn, xsi, G, yi, ldy); break;
            default: row_tile(kind, gs, 4, xi, K, qn, sn, mn, xsi, G, yi, ldy); break;
            }
        }
    }
}

static void q4_rows(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *s,
                    const float *m, int64_t n0, int64_t n1, float *y, int64_t ldy,
                    const float *xs) {
    rows_kind(0, 32, x, M, K, q, s, m, n0, n1, y, ldy, xs);
}

static void q8_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                    const float *m, int64_t gs, int64_t n0, int64_t n1, float *y, int64_t ldy,
                    const float *xs) {
    if (gs == 32) rows_kind(1, 32, x, M, K, q, s, m, n0, n1, y, ldy, xs);
    else rows_kind(1, 16, x, M, K, q, s, m, n0, n1, y, ldy, xs);
}

#else  /* portable C */

static void q4_rows(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *s,
                    const float *m, int64_t n0, int64_t n1, float *y, int64_t ldy,
                    const float *xs) {
    const int64_t G = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t i = 0; i < M; i++) {
            float acc = 0.f, macc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *qb = q + (n * G + g) * 16;
                const float *xg = x + i * K + g * 32;
                float t = 0.f;
                for (int v = 0; v < 32; v++) t += xg[v] * (float)Q4_VAL(qb, v);
                acc += t * s[n * G + g];
                macc += m[n * G + g] * xs[i * G + g];
            }
            y[i * ldy + n] = acc + macc;
        }
}

static void q8_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s,
                    const float *m, int64_t gs, int64_t n0, int64_t n1, float *y, int64_t ldy,
                    const float *xs) {
    const int64_t G = K / gs;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t i = 0; i < M; i++) {
            float acc = 0.f, macc = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *qb = q + n * K + g * gs;
                const float *xg = x + i * K + g * gs;
                float t = 0.f;
                for (int64_t j = 0; j < gs; j++) t += xg[j] * (float)qb[j];
                acc += t * s[n * G + g];
                if (m) macc += m[n * G + g] * xs[i * G + g];
            }
            y[i * ldy + n] = acc + macc;
        }
}
#endif

/* kind 0 = q4 (gs 32), 1 = q8 (gs 16 or 32). y has row stride ldy (columns n of this weight). */
void lm_qmatmul(int kind, const float *x, int64_t M, int64_t K, const void *q, const float *s,
                const float *m, int64_t gs, int64_t N, float *y, int64_t ldy, int nt) {
    int64_t G = K / gs;
    float stackbuf[1024];
    float *xs = M * G <= 1024 ? stackbuf : (float *)malloc(sizeof(float) * M * G);
    group_sums(x, M, K, gs, xs);
    if (nt < 1) nt = 1;
    /* split output rows into nt contiguous chunks of multiples of 8 rows */
    #pragma omp parallel for num_threads(nt) if(nt > 1 && N >= 64) schedule(static)
    for (int t = 0; t < nt; t++) {
        int64_t chunk = ((N + nt - 1) / nt + 7) / 8 * 8;
        int64_t n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 >= n1) continue;
        if (kind == 0) q4_rows(x, M, K, (const uint8_t *)q, s, m, n0, n1, y, ldy, xs);
        else q8_rows(x, M, K, (const int8_t *)q, s, m, gs, n0, n1, y, ldy, xs);
    }
    if (xs != stackbuf) free(xs);
}

/* fp16 bits -> float (IEEE binary16, subnormals included) */
static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, f;
    if (e == 0) {
        if (!m) f = sign;
        else { e = 113; while (!(m & 1024)) { m <<= 1; e--; } f = sign | (e << 23) | ((m & 1023) << 13); }
    } else if (e == 31) f = sign | 0x7F800000 | (m << 13);
    else f = sign | ((e + 112) << 23) | (m << 13);
    float r; memcpy(&r, &f, 4); return r;
}

/* 8 values of a K/V row (float32 or float16) at p + j */
#ifdef __AVX2__
AI __m256 kv8(const void *p, int64_t j, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + j)))
               : _mm256_loadu_ps((const float *)p + j);
}
#endif
static inline float kv1(const void *p, int64_t j, int f16) {
    return f16 ? h2f(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}

/* One query per head over L cached keys (decode): o[h] = softmax(scale * q[h] . K[:, h/g]) V[:, h/g]
   with g = H / Hkv. q [H, D], o [H, Dv] float32; k [L, Hkv, D], v [L, Hkv, Dv] rows with the
   given row strides (elements), float32 or float16 (kv_f16); scratch >= L floats. */
void lm_attn_decode(const float *q, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                    const void *k, int64_t k_rs, const void *v, int64_t v_rs, int kv_f16,
                    int64_t L, float scale, float *o, float *scratch) {
    const int64_t g = H / Hkv;
    const int es = kv_f16 ? 2 : 4;
    for (int64_t h = 0; h < H; h++) {
        const int64_t kh = h / g;
        const float *qh = q + h * D;
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            const char *kr = (const char *)k + (j * k_rs + kh * D) * es;
            float d = 0.f;
            int64_t t = 0;
#ifdef __AVX2__
            __m256 a = _mm256_setzero_ps();
            for (; t + 8 <= D; t += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + t), kv8(kr, t, kv_f16), a);
            d = hsum8(a);
#endif
            for (; t < D; t++) d += qh[t] * kv1(kr, t, kv_f16);
            d *= scale;
            scratch[j] = d;
            if (d > mx) mx = d;
        }
        float sum = 0.f;
        for (int64_t j = 0; j < L; j++) { scratch[j] = expf(scratch[j] - mx); sum += scratch[j]; }
        float *oh = o + h * Dv;
        for (int64_t t = 0; t < Dv; t++) oh[t] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            const char *vr = (const char *)v + (j * v_rs + kh * Dv) * es;
            const float p = scratch[j];
            int64_t t = 0;
#ifdef __AVX2__
            __m256 pv = _mm256_set1_ps(p);
            for (; t + 8 <= Dv; t += 8)
                _mm256_storeu_ps(oh + t, _mm256_fmadd_ps(pv, kv8(vr, t, kv_f16), _mm256_loadu_ps(oh + t)));
#endif
            for (; t < Dv; t++) oh[t] += p * kv1(vr, t, kv_f16);
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < Dv; t++) oh[t] *= inv;
    }
}

/* y[i, :] = x[i, :] / sqrt(mean(x[i, :]^2) + eps) * w  (w may be NULL); float32 like torch's
   rms_norm except the order of the sum of squares (8 partial sums) */
void lm_rms_norm(const float *x, int64_t M, int64_t K, const float *w, float eps, float *y) {
    for (int64_t i = 0; i < M; i++) {
        const float *xi = x + i * K;
        float *yi = y + i * K;
        float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int64_t j = 0;
        for (; j + 8 <= K; j += 8)
            for (int l = 0; l < 8; l++) p[l] += xi[j + l] * xi[j + l];
        float ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
        for (; j < K; j++) ss += xi[j] * xi[j];
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        if (w) for (j = 0; j < K; j++) yi[j] = (xi[j] * r) * w[j];
        else for (j = 0; j < K; j++) yi[j] = xi[j] * r;
    }
}

/* out[r, :] = dequantized row idx[r] (idx NULL: rows 0..R-1) of an N-row weight; plain float
   ops, no contraction. Returns 0, or 1 + the position of the first row index outside [0, N) (nothing written). */
int64_t lm_dequant_rows(int kind, const void *q, const float *s, const float *m, int64_t gs,
                        int64_t K, const int64_t *idx, int64_t R, int64_t N, float *out, int nt) {
    const int64_t G = K / gs;
    if (idx) {
        for (int64_t r = 0; r < R; r++)
            if (idx[r] < 0 || idx[r] >= N) return r + 1;
    } else if (R > N) {
        return N + 1;
    }
    #pragma omp parallel for num_threads(nt) if(nt > 1 && R >= 64) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        int64_t n = idx ? idx[r] : r;
        float *o = out + r * K;
        for (int64_t g = 0; g < G; g++) {
            float sg = s[n * G + g], mg = m ? m[n * G + g] : 0.f;
            if (kind == 0) {
                const uint8_t *qb = (const uint8_t *)q + (n * G + g) * 16;
                for (int v = 0; v < 32; v++) {
                    float a = sg * (float)Q4_VAL(qb, v);
                    o[g * 32 + v] = m ? a + mg : a;
                }
            } else {
                const int8_t *qb = (const int8_t *)q + n * K + g * gs;
                for (int64_t j = 0; j < gs; j++) {
                    float a = sg * (float)qb[j];
                    o[g * gs + j] = m ? a + mg : a;
                }
            }
        }
    }
    return 0;
}
