"""Exact matmuls on GGUF block-quantized weights kept packed in memory (CPU, float32 activations).

Why: the torch reference dequantizes every weight to float32 at load, so a CPU decode step reads
4 bytes per weight (0.54 GB per token for SmolLM2-135M) and is memory-bandwidth bound. Here the
weights stay in a compact form that represents the GGUF values *exactly*, and a small C kernel
(AVX2/FMA when the CPU has it, plain C otherwise) computes ``x @ W.T`` with float32 activations
and float32 accumulation -- the same function as the float path up to float32 summation order.
PyTorch's own int4 CPU kernels (``_weight_int4pack_mm_for_cpu``) were measured first: with float32
activations they run a scalar loop (~35x slower than an fp32 GEMV here) and their vectorized path
rounds activations, scales and outputs to bfloat16, which is not exact.

Packed layout of a weight ``W [N, K]`` (N output rows, K input values, groups along K):

=====  ============================================  =========================================
kind   values ``q``                                  per group (``G = K / group``)
=====  ============================================  =========================================
q4     ``uint8 [N, K/32, 16]``: byte 4w+j of a       ``s, m: float32 [N, G]``;
       group holds value 8j+w (low nibble) and       ``w = s * q + m``, q in 0..15, group 32
       8j+w+4 (high nibble), see ``_pack_q4``
q8     ``int8 [N, K]``                               ``s: float32 [N, G]``, ``m`` float32 or
                                                     None; ``w = s * q (+ m)``, group 32 or 16
=====  ============================================  =========================================

GGUF types map exactly (ggml ``dequantize_row_*`` formulas, ggml-quants.c):
Q4_0 -> q4 (s = d, m = -8d), Q4_1 -> q4 (s = d, m = m), Q4_K -> q4 per 32-value sub-block
(s = d*sc, m = -dmin*mn), Q5_0 -> q8 (q - 16, s = d), Q5_1 -> q8 (s = d, m = m), Q5_K -> q8
(s = d*sc, m = -dmin*mn), Q8_0 -> q8 (s = d), Q6_K -> q8 group 16 (q - 32, s = d*sc). Every
product/sum here is exact in float32 or is the same float32 operation ggml performs, so
:meth:`PackedWeight.dequantize` reproduces :func:`localmoe.io.dequant.dequantize` bit for bit.

The kernel: for each output row and group, unpack the group's values to float32 lanes, dot them
with ``x``'s group (FMA), scale the partial dot by ``s`` into a vector accumulator, and add
``m * sum(x_group)``. Decode (one row of ``x``) runs two adjacent weight rows at once (``x``
loaded once, two independent chains) with software prefetch ~1 KB ahead; output rows are split
over ``torch.get_num_threads()`` OpenMP threads (torch's own libgomp). Batches up to
``SMALL_M`` rows use the kernel; larger ones (prefill) dequantize each weight into a scratch
float32 matrix and call BLAS. On the 2-core VM (SmolLM2-135M Q4_1, 1 thread) a decode step reads
~106 MB of weights instead of ~620 MB.

Also here, for the decode path of models loaded with packed weights (same functions as the torch
ops up to float32 summation order): :func:`rms_norm` and :func:`attention_decode` (one C call
each instead of ~7 and ~12 small torch ops, whose dispatch overhead dominates a 135M-parameter
model's decode step).

The C source below is compiled once with the system C compiler into a per-user cache directory
(``$LOCALMOE_KERNEL_CACHE`` or platformdirs' user cache dir) and loaded with ctypes; without a
compiler (or with ``LOCALMOE_CPU_QMATMUL=0``) :func:`kernel_status` gives the reason and callers
keep the float32 path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import localmoe.io.dequant as dq

__all__ = ["PackedWeight", "PackedLinear", "kernel_status", "pack_gguf", "rms_norm",
           "PACKABLE_QTYPES"]

#: rows of ``x`` up to which the fused kernel runs; above, dequantize + BLAS (measured on the
#: 2-core VM for a 576x3072 Q4_1 weight: kernel 0.74 ms vs 5.9 ms at 8 rows, 7.1 vs 8.9 ms at 64,
#: 19.5 vs 18.2 ms at 128)
SMALL_M = 64

_C_SOURCE = r"""
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

/* out[r, :] = dequantized row idx[r] (idx NULL: rows 0..R-1); plain float ops, no contraction */
void lm_dequant_rows(int kind, const void *q, const float *s, const float *m, int64_t gs,
                     int64_t K, const int64_t *idx, int64_t R, float *out, int nt) {
    const int64_t G = K / gs;
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
}
"""

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_reason: str | None = None
_lib_tried = False


def _cache_dir() -> Path:
    d = os.environ.get("LOCALMOE_KERNEL_CACHE")
    if d:
        return Path(d)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("localmoe", appauthor=False)) / "cpu_kernels"
    except ImportError:
        return Path(tempfile.gettempdir()) / f"localmoe-cpu-kernels-{os.getuid()}"


def _simd_flags() -> list[str]:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        cap = ""
    if platform.machine().lower() in ("x86_64", "amd64") and cap in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("LOCALMOE_CPU_QMATMUL", "1").lower() in ("0", "off", "false", "no"):
        return None, "disabled by LOCALMOE_CPU_QMATMUL=0"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc/gcc) found"
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp", *_simd_flags()]
    key = hashlib.sha256((_C_SOURCE + " ".join(flags) + cc + platform.machine()).encode())
    d = _cache_dir()
    so = d / f"qmatmul_{key.hexdigest()[:16]}.so"
    if not so.exists():
        try:
            d.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src = Path(tmp) / "qmatmul.c"
                src.write_text(_C_SOURCE)
                out = Path(tmp) / "qmatmul.so"
                p = subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True,
                                   text=True, timeout=120)
                if p.returncode:
                    return None, f"compiling the CPU kernel failed: {p.stderr.strip()[-300:]}"
                os.replace(out, so)  # atomic: concurrent builders race harmlessly
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"cannot build the CPU kernel: {e}"
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        return None, f"cannot load the CPU kernel: {e}"
    i64, vp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.lm_qmatmul.argtypes = [i32, vp, i64, i64, vp, vp, vp, i64, i64, vp, i64, i32]
    lib.lm_qmatmul.restype = None
    lib.lm_dequant_rows.argtypes = [i32, vp, vp, vp, i64, i64, vp, i64, vp, i32]
    lib.lm_dequant_rows.restype = None
    lib.lm_rms_norm.argtypes = [vp, i64, i64, vp, ctypes.c_float, vp]
    lib.lm_rms_norm.restype = None
    lib.lm_attn_decode.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i32, i64,
                                   ctypes.c_float, vp, vp]
    lib.lm_attn_decode.restype = None
    return lib, None


def _get_lib() -> ctypes.CDLL | None:
    global _lib, _lib_reason, _lib_tried
    if not _lib_tried:
        with _lib_lock:
            if not _lib_tried:
                _lib, _lib_reason = _build()
                _lib_tried = True
    return _lib


def kernel_status() -> str | None:
    """None when the packed CPU kernel is usable, else the reason it is not (no compiler,
    disabled by ``LOCALMOE_CPU_QMATMUL=0``, build error). Builds it on first call (~1 s)."""
    _get_lib()
    return _lib_reason


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of contiguous float32 CPU ``x [..., K]`` with float32 ``w [K]`` (or None) in one C
    call: ``x / sqrt(mean(x^2) + eps) * w`` (torch's formula; only the summation order of
    ``x^2`` differs). Saves the ~7 small torch ops whose overhead dominates at decode.

    Raises:
        RuntimeError: the kernel is unavailable (check :func:`kernel_status` first).
    """
    lib = _get_lib()
    if lib is None:
        raise RuntimeError(f"CPU kernel unavailable: {_lib_reason}")
    K = x.shape[-1]
    y = torch.empty_like(x)
    lib.lm_rms_norm(x.data_ptr(), x.numel() // K, K, None if w is None else w.data_ptr(),
                    float(eps), y.data_ptr())
    return y


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """Decode attention of one new query per head over all ``L`` given keys (no mask: the
    caller passes exactly the keys the query sees), in one C call.

    Args:
        q: float32 contiguous ``[1, H, D]`` (CPU).
        k: ``[L, Hkv, D]``, v: ``[L, Hkv, Dv]``; float32 or float16, each row contiguous
            (``stride(-1) == 1``, ``stride(-2) == D``), e.g. slices of a float KV store.
        scale: logit scale.

    Returns:
        float32 ``[1, H, Dv]``: ``softmax(scale * q k^T) v`` per head, GQA head ``h`` reading
        kv head ``h // (H / Hkv)``.

    Raises:
        RuntimeError: kernel unavailable. ValueError: unsupported dtypes or layout.
    """
    lib = _get_lib()
    if lib is None:
        raise RuntimeError(f"CPU kernel unavailable: {_lib_reason}")
    _, H, D = q.shape
    L, Hkv, Dk = k.shape
    Dv = v.shape[-1]
    f16 = k.dtype == torch.float16
    if (q.dtype != torch.float32 or k.dtype != v.dtype or k.dtype not in (torch.float16, torch.float32)
            or Dk != D or H % Hkv or not q.is_contiguous() or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.stride(-2) != D or v.stride(-2) != Dv):
        raise ValueError("attention_decode: unsupported dtypes or layout")
    o = torch.empty(1, H, Dv, dtype=torch.float32)
    scratch = torch.empty(max(L, 1), dtype=torch.float32)
    lib.lm_attn_decode(q.data_ptr(), H, Hkv, D, Dv, k.data_ptr(), k.stride(0), v.data_ptr(),
                       v.stride(0), int(f16), L, float(scale), o.data_ptr(), scratch.data_ptr())
    return o


class PackedWeight:
    """One weight matrix ``W [N, K]`` in the packed form of the module docstring (CPU tensors).

    Attributes:
        kind: ``"q4"`` or ``"q8"``.
        q: ``uint8 [N, K/32, 16]`` (q4) or ``int8 [N, K]`` (q8).
        s: ``float32 [N, K/group]`` group scales; m: same shape or None (zero) -- group offsets.
        group: values per group along K (32, or 16 for Q6_K).
        shape: ``(N, K)``.
    """

    def __init__(self, kind: str, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None,
                 group: int):
        if kind not in ("q4", "q8") or (kind == "q4" and group != 32) or group not in (16, 32):
            raise ValueError(f"bad packed kind/group {kind}/{group}")
        self.kind, self.group = kind, int(group)
        self.q = q.contiguous()
        self.s = s.to(torch.float32).contiguous()
        self.m = None if m is None else m.to(torch.float32).contiguous()
        N = self.q.shape[0]
        K = self.s.shape[1] * self.group
        self.shape = (N, K)
        self._k = 0 if kind == "q4" else 1
        self._call = None   # bound kernel call, built on first use (pointers stay valid)

    @property
    def nbytes(self) -> int:
        """Bytes held (values, scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.m) if t is not None)

    def _ptrs(self):
        return (self.q.data_ptr(), self.s.data_ptr(), self.m.data_ptr() if self.m is not None else None)

    def matmul_into(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[:, :] = x @ W.T`` for float32 contiguous ``x [M, K]``; ``y`` a float32 ``[M, N]``
        view whose rows may be strided (a column slice of a larger output)."""
        if self._call is None:
            lib = _get_lib()
            q, s, m = self._ptrs()
            fn = lib.lm_qmatmul
            k, gs, K, N = self._k, self.group, self.shape[1], self.shape[0]
            self._call = lambda xp, M, yp, ldy, nt: fn(k, xp, M, K, q, s, m, gs, N, yp, ldy, nt)
        self._call(x.data_ptr(), x.shape[0], y.data_ptr(), y.stride(0), torch.get_num_threads())

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[R, K]`` of the rows ``rows`` (int64 ``[R]``; None: all ``N`` rows),
        bit-identical to :func:`localmoe.io.dequant.dequantize` of the source tensor."""
        lib = _get_lib()
        K = self.shape[1]
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            R = rows.shape[0]
        else:
            R = self.shape[0]
        out = torch.empty(R, K, dtype=torch.float32)
        q, s, m = self._ptrs()
        lib.lm_dequant_rows(self._k, q, s, m, self.group, K,
                            rows.data_ptr() if rows is not None else None, R, out.data_ptr(),
                            torch.get_num_threads())
        return out

    @staticmethod
    def cat(parts: Sequence["PackedWeight"]) -> "PackedWeight":
        """Stack weights of the same kind and group along N (e.g. fused q/k/v). Offsets absent in
        some parts are materialized as zeros."""
        p0 = parts[0]
        if any(p.kind != p0.kind or p.group != p0.group or p.shape[1] != p0.shape[1] for p in parts):
            raise ValueError("packed parts differ in kind, group or K")
        m = None
        if any(p.m is not None for p in parts):
            m = torch.cat([p.m if p.m is not None else torch.zeros_like(p.s) for p in parts])
        return PackedWeight(p0.kind, torch.cat([p.q for p in parts]),
                            torch.cat([p.s for p in parts]), m, p0.group)


class PackedLinear:
    """A (possibly fused) linear layer ``y = x @ W.T`` whose row blocks are packed weights.

    Fused projections (q/k/v, gate/up) whose parts share kind and group become one
    :class:`PackedWeight`; parts that differ (e.g. Q5_0 q/k with a Q8_0 v are both q8 and fuse,
    a Q4_K part next to a Q6_K one does not) stay separate and write adjacent column ranges.

    Args:
        parts: weights with equal K, in output order.

    Attributes:
        in_features (K), out_features (sum of N).
    """

    def __init__(self, parts: Sequence[PackedWeight]):
        groups: list[list[PackedWeight]] = []
        for p in parts:
            if groups and groups[-1][0].kind == p.kind and groups[-1][0].group == p.group:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.parts = [g[0] if len(g) == 1 else PackedWeight.cat(g) for g in groups]
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)

    #: where and in which dtype the layer computes (the kernel is CPU float32 only)
    device = torch.device("cpu")
    dtype = torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes held by all parts."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` float32 -> ``[M, out_features]`` float32 (any leading shape flattened)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        M = x2.shape[0]
        if M > SMALL_M:
            # prefill: dequantize each part once and let BLAS do the matmul
            outs = [x2 @ p.dequantize().t() for p in self.parts]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        else:
            y = torch.empty(M, self.out_features, dtype=torch.float32)
            if len(self.parts) == 1:
                self.parts[0].matmul_into(x2, y)
            else:
                c = 0
                for p in self.parts:
                    n = p.shape[0]
                    p.matmul_into(x2, y[:, c:c + n])
                    c += n
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out_features, in_features]`` (the float weight)."""
        ws = [p.dequantize() for p in self.parts]
        return ws[0] if len(ws) == 1 else torch.cat(ws, 0)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, in_features]``: rows ``idx`` (int64 ``[R]``) of the float weight (an
        embedding lookup on a tied embedding/output matrix). Needs a single part."""
        if len(self.parts) != 1:
            return self.dequantize().index_select(0, idx)
        return self.parts[0].dequantize(idx)


# ---- packing GGUF blocks -------------------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)


_Q4_LO = torch.tensor([8 * (b % 4) + b // 4 for b in range(16)])


def _pack_q4(v: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes in the kernel's order: byte ``4w + j`` holds
    value ``8j + w`` (low nibble) and ``8j + w + 4`` (high nibble), so that 32-bit word ``w``
    shifted right by ``4p`` yields value ``8(p // 2) + w + 4(p % 2)``: AVX2 lanes unpack with
    per-lane shifts, no shuffles."""
    return (v[..., _Q4_LO] | (v[..., _Q4_LO + 4] << 4)).to(torch.uint8)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] bit j of the u32."""
    sh = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> sh) & 1).reshape(qh.shape[0], 32)


def _nib(qs: torch.Tensor) -> torch.Tensor:
    """[n, c, 32] bytes -> [n, c, 2, 32] (low nibbles, then high nibbles)."""
    sh = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (qs.unsqueeze(-2) >> sh) & 0x0F


def _blocks_to_packed(b: torch.Tensor, qtype: int) -> tuple[str, torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None, int]:
    """GGUF blocks ``uint8 [n, block_bytes]`` (one tensor row after another) -> (kind, values
    per group ``[n_groups, ...]``, s, m, group) with groups in the row's order."""
    n = b.shape[0]
    if qtype == dq.Q4_0:
        d = _f16(b[:, 0:2])
        v = _nib(b[:, 2:18].reshape(n, 1, 16)).reshape(n, 32)
        return "q4", _pack_q4(v), d, -8.0 * d, 32
    if qtype == dq.Q4_1:
        v = _nib(b[:, 4:20].reshape(n, 1, 16)).reshape(n, 32)
        return "q4", _pack_q4(v), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32
    if qtype == dq.Q4_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = dq._k_scale_min(b[:, 4:16])
        s = (d * sc.to(torch.float32)).reshape(n * 8)
        m = -(dmin * mn.to(torch.float32)).reshape(n * 8)
        v = _nib(b[:, 16:144].reshape(n, 4, 32)).reshape(n * 8, 32)
        return "q4", _pack_q4(v), s, m, 32
    if qtype == dq.Q8_0:
        return "q8", b[:, 2:34].contiguous().view(torch.int8), _f16(b[:, 0:2]), None, 32
    if qtype in (dq.Q5_0, dq.Q5_1):
        o = 2 if qtype == dq.Q5_0 else 4
        d = _f16(b[:, 0:2])
        qh = _bits(b[:, o:o + 4])
        ql = _nib(b[:, o + 4:o + 20].reshape(n, 1, 16)).reshape(n, 32)
        q = (ql | (qh << 4)).to(torch.int8)
        if qtype == dq.Q5_0:
            return "q8", q - 16, d, None, 32
        return "q8", q, d, _f16(b[:, 2:4]), 32
    if qtype == dq.Q5_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = dq._k_scale_min(b[:, 4:16])
        s = (d * sc.to(torch.float32)).reshape(n * 8)
        m = -(dmin * mn.to(torch.float32)).reshape(n * 8)
        sh = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        hi = (b[:, 16:48].unsqueeze(1) >> sh) & 1
        ql = _nib(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
        return "q8", (ql | (hi << 4)).to(torch.int8).reshape(n * 8, 32), s, m, 32
    if qtype == dq.Q6_K:
        ql = b[:, 0:128].reshape(n, 2, 1, 64)
        qh = b[:, 128:192].reshape(n, 2, 1, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        d = _f16(b[:, 208:210])[:, None]
        s = (d * sc).reshape(n * 16)
        lo = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
        hi = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
              ).reshape(n, 8, 32)
        q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n * 16, 16)
        return "q8", q, s, None, 16
    raise ValueError(f"qtype {qtype} cannot be packed")


#: ggml type ids :func:`pack_gguf` accepts
PACKABLE_QTYPES = frozenset({dq.Q4_0, dq.Q4_1, dq.Q4_K, dq.Q5_0, dq.Q5_1, dq.Q5_K, dq.Q8_0,
                             dq.Q6_K})


def pack_gguf(data: np.ndarray | torch.Tensor, qtype: int, shape: Sequence[int]) -> PackedWeight:
    """Pack a 2-D GGUF tensor's block bytes into a :class:`PackedWeight`.

    Args:
        data: ``uint8`` block bytes of the tensor (e.g. ``RawTensor.data``), ``N`` rows.
        qtype: ggml type id, one of :data:`PACKABLE_QTYPES`.
        shape: torch-order ``(N, K)``.

    Raises:
        ValueError: not 2-D, or ``qtype`` not packable.
    """
    if len(shape) != 2 or int(qtype) not in PACKABLE_QTYPES:
        raise ValueError(f"cannot pack qtype {qtype} shape {tuple(shape)}")
    N, K = int(shape[0]), int(shape[1])
    bs, ts = dq.BLOCK_SIZES[int(qtype)]
    if isinstance(data, np.ndarray):
        # zero-copy view of the (read-only) file mapping: packing only reads it; torch warns
        # about non-writable arrays, which is the point here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
    b = data.reshape(N, -1)
    # rows in chunks of ~64k blocks, written into preallocated outputs: temporaries stay small
    # (a 262144 x 640 Q8_0 embedding would otherwise need several copies of its 170 MB)
    step = max(1, (1 << 16) // max(1, b.shape[1] // ts))
    q = s_out = m_out = None
    for r0 in range(0, N, step):
        kind, qc, sc, mc, group = _blocks_to_packed(b[r0:r0 + step].reshape(-1, ts), int(qtype))
        rows = min(step, N - r0)
        G = K // group
        if q is None:
            q = torch.empty((N, G, 16) if kind == "q4" else (N, K), dtype=qc.dtype)
            s_out = torch.empty(N, G, dtype=torch.float32)
            m_out = None if mc is None else torch.empty(N, G, dtype=torch.float32)
        q[r0:r0 + rows] = qc.reshape(rows, *q.shape[1:])
        s_out[r0:r0 + rows] = sc.reshape(rows, G)
        if m_out is not None:
            m_out[r0:r0 + rows] = mc.reshape(rows, G)
    return PackedWeight(kind, q, s_out, m_out, group)
