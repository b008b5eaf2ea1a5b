// Linear layers over GGUF-quantized weights, dequantized in registers: y = x W^T.
//
// GGUF stores W [N, K] row by row, each row K / 32 blocks of one ggml type (Q8_0: an fp16
// scale d and 32 int8, w = d q; Q4_0: d and 32 4-bit q, w = d (q - 8); Q4_1: d, an fp16
// minimum m and 32 4-bit q, w = d q + m; element j of a Q4 block is the low nibble of
// byte j, element j + 16 the high one). ``quant_pack`` interleaves the blocks of 16
// consecutive rows, the same bits in the same number of bytes (llama.cpp's CPU backend
// repacks Q4_0 the same way): for each group of 16 rows and each block column, the 16
// rows' d (32 bytes), their m (Q4_1, 32 bytes), then the quants with the rows innermost
// (Q4: 16 x 16 bytes, byte j of every row; Q8_0: 32 x 16 bytes). One byte load then
// widens to the same element of 16 rows, 16 output rows live in the lanes of one vector,
// and a task reads one contiguous run of memory.
//
// Per block x . w = d (x . q) + m sum(x) (Q4_0: d (x . q - 8 sum(x))): the quants are
// converted to floats and multiplied into fp32 accumulators with x broadcast, the scales
// applied once per block. The result equals the dequantized weight's fp32 product up to
// rounding order, at 4.5 to 8.5 bits of weight read per value.
//
// K-quants come in super-blocks of 256 weights: Q4_K has an fp16 d and dmin and eight
// 32-weight sub-blocks with 6-bit scale and min (w = d sc q - dmin mn, q 4 bits; the low
// nibbles of 32 bytes are one sub-block, their high nibbles the next); Q6_K has an fp16 d
// and sixteen 16-weight sub-blocks with an int8 scale (w = d sc (q - 32), q 6 bits split
// into 4 low bits in ql and 2 high bits in qh). They are interleaved the same way: per
// group and super-block the 16 rows' d (and dmin), then each scale byte of the 16 rows,
// then each quant byte of the 16 rows. Q4_K's 12 bytes of packed 6-bit scales and mins
// are unpacked to one byte each (148 bytes per 256 weights instead of 144, 4.6 bits per
// weight) so the kernel widens them like quants; Q6_K keeps its 210 bytes. d sc is exact
// in fp32 (11 x 8 significant bits), so these too equal the dequantized weights' product
// up to rounding order.
//
// Decode batches are done against the quants directly, pass_rows<T>() rows of x per pass
// over a group (the group stays in L1 between passes); from gemm_rows() rows on (long
// prompt chunks) pieces of W are expanded to fp32 once and multiplied by torch's fp32 GEMM.
//
// A bf16 x (a --dtype bfloat16 model) is widened to fp32 for the decode kernels (exact) and
// the result rounded to bf16; from gemm_rows() rows W is expanded to bf16 instead and
// multiplied by torch's bf16 GEMM (AVX512_BF16 dot products: ~2x the fp32 rate on a Zen 4).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

constexpr int QK = 32;  // weights per block
constexpr int G = W;    // rows per interleaved group (one vector lane each)
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

// Rows of x per pass against the quants (their accumulators fill the vector registers),
// and from how many rows on W is expanded for torch's GEMM instead. On a 2-core Zen 4 the
// fp32 kernels in registers (8 rows a pass) beat expand + GEMM at every prompt size up
// to 1024 rows (the default model's prefill of 256 tokens: 330 against 375 ms; 512: 712
// against 787 ms; bench/RESULTS.md, issue 15), so fp32 takes the GEMM only for longer
// chunks; K-quants (more integer work per weight) from 64 rows. bf16's GEMM runs at twice
// the fp32 rate on AVX512_BF16 and wins from ~48 rows.
#if defined(__AVX512F__)
constexpr int kMaxRegRows = 8;  // 32 vector registers
constexpr int64_t kGemmRows = 1024, kGemmRowsKQuant = 64, kGemmRowsBf16 = 48;
#else
constexpr int kMaxRegRows = 2;  // 16 registers, each vf two of them
constexpr int64_t kGemmRows = 16, kGemmRowsKQuant = 2, kGemmRowsBf16 = 16;
#endif
constexpr int64_t kGemmChunkBytes = 4 << 20;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// 16 fp16 values to floats.
inline vf halves(const uint8_t* p) {
  vf r;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&r, &v, sizeof(r));
#elif defined(__F16C__)
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  std::memcpy(&r, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(a), &b, sizeof(b));
#else
  for (int j = 0; j < W; ++j) r[j] = half_at(p + 2 * j);
#endif
  return r;
}

// 16 bytes to 16 int32 lanes, zero- or sign-extended. GCC scalarizes a vector-extension
// conversion from bytes (a byte extract per lane), so the AVX-512 / AVX2 widening
// instructions are asked for by name.
template <bool Signed>
inline vi widen(const uint8_t* p) {
  vi r;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i v = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&r, &v, sizeof(r));
#elif defined(__AVX2__)
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  const __m256i a = Signed ? _mm256_cvtepi8_epi32(lo) : _mm256_cvtepu8_epi32(lo);
  const __m256i b = Signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
  std::memcpy(&r, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(a), &b, sizeof(b));
#else
  for (int j = 0; j < W; ++j) r[j] = Signed ? static_cast<int8_t>(p[j]) : p[j];
#endif
  return r;
}

template <int64_t T>
constexpr bool is_k_quant() {
  return T == kQ4_K || T == kQ6_K;
}
template <int64_t T>
constexpr int64_t block_weights() {  // weights per (super-)block of one row
  return is_k_quant<T>() ? 256 : QK;
}
template <int64_t T>
constexpr int64_t gguf_block_bytes() {  // GGUF bytes per block of one row
  return T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ4_K ? 144 : 210;
}
template <int64_t T>
constexpr int64_t block_bytes() {  // packed bytes per block of one row (Q4_K: scales unpacked)
  return T == kQ4_K ? 148 : gguf_block_bytes<T>();
}
// From how many rows of x on W is expanded for torch's GEMM (see kGemmRows; AVX2 runs
// K-quants one row per pass: from 2 rows the GEMM is faster).
template <int64_t T>
constexpr int64_t gemm_rows(bool bf16) {
  return bf16 ? kGemmRowsBf16 : is_k_quant<T>() ? kGemmRowsKQuant : kGemmRows;
}
// Rows of x per pass against a group: as many as their accumulators leave registers for.
template <int64_t T>
constexpr int pass_rows() {
#if defined(__AVX512F__)
  return T == kQ6_K ? 4 : kMaxRegRows;
#else
  return is_k_quant<T>() ? 1 : kMaxRegRows;
#endif
}
template <int64_t T>
constexpr int64_t quants_at() {  // offset of the quants in an interleaved group block
  return T == kQ4_1 ? 4 * G : 2 * G;
}

// Quants of element pair j (Q4: elements j and j + 16; Q8_0: element j) of 16 rows.
template <int64_t T>
inline void quants(const uint8_t* gb, int j, vf& lo, vf& hi) {
  if constexpr (T == kQ8_0) {
    lo = __builtin_convertvector(widen<true>(gb + quants_at<T>() + j * G), vf);
    hi = __builtin_convertvector(widen<true>(gb + quants_at<T>() + (j + 16) * G), vf);
  } else {
    const vi q = widen<false>(gb + quants_at<T>() + j * G);  // x86 has no byte shifts
    lo = __builtin_convertvector(q & 15, vf);
    hi = __builtin_convertvector(q >> 4, vf);
  }
}

// out[m][r0 + r] for M rows of x and one group of 16 weight rows, `rows` of them real.
// x is block-major: xb[(b * M + m) * 32 + j] = x[m][b * 32 + j], so every broadcast in a
// block is one base register plus a constant (row-major x needed a pointer per row and
// element: 256 of them, spilled to the stack). xsum[b * M + m]: sum of that block of x.
template <int64_t T, int M>
void group_rows(float* out, int64_t out_stride, const float* xb, const float* xsum, const uint8_t* g,
                int64_t k, int rows) {
  constexpr int NC = M >= 4 ? 2 : 8 / M;  // independent FMA chains per row of x
  constexpr int64_t GB = G * block_bytes<T>();
  const int64_t nb = k / QK;
  vf acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = vf{};
  for (int64_t b = 0; b < nb; ++b, g += GB, xb += M * QK) {
    vf s[M][NC];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) s[m][c] = vf{};
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      vf lo, hi;
      quants<T>(g, j, lo, hi);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        s[m][(2 * j) % NC] += lo * xb[m * QK + j];
        s[m][(2 * j + 1) % NC] += hi * xb[m * QK + j + 16];
      }
    }
    const vf d = halves(g);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      vf t = s[m][0];
#pragma GCC unroll 8
      for (int c = 1; c < NC; ++c) t += s[m][c];
      const float xs = xsum[b * M + m];
      if constexpr (T == kQ8_0) {
        acc[m] += t * d;
      } else if constexpr (T == kQ4_0) {
        acc[m] += (t - 8.f * xs) * d;
      } else {
        acc[m] += t * d + halves(g + 2 * G) * xs;
      }
    }
  }
  for (int m = 0; m < M; ++m) std::memcpy(out + m * out_stride, &acc[m], rows * sizeof(float));
}

inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }

// Q4_K: M rows of x against one group of 16 rows (layout: see the top of the file; per
// super-block d at 0, dmin at 2G, the sub-blocks' scales at 4G, mins at 12G, quants at 20G).
template <int M>
void group_rows_q4k(float* out, int64_t out_stride, const float* xb, const float* xsum, const uint8_t* g,
                    int64_t k, int rows) {
#if defined(__AVX512F__)
  constexpr int NC = M >= 4 ? 1 : 4 / M;  // FMA chains per row of x and sub-block
#else
  constexpr int NC = 2;
#endif
  constexpr int64_t GB = G * block_bytes<kQ4_K>();
  vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = vf{};
  for (int64_t sb = 0; sb < k / 256; ++sb, g += GB) {
    const vf d = halves(g), dmin = halves(g + 2 * G);
    for (int c = 0; c < 4; ++c) {  // 32 quant bytes: sub-block 2c low nibbles, 2c + 1 high
      const int64_t s0 = sb * 8 + 2 * c;
      const float* x0 = xb + s0 * M * QK;
      const float* x1 = x0 + M * QK;
      vf lo_s[M][NC], hi_s[M][NC];
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < NC; ++i) lo_s[m][i] = hi_s[m][i] = vf{};
#pragma GCC unroll 8
      for (int l = 0; l < 32; ++l) {
        const vi q = widen<false>(g + 20 * G + (c * 32 + l) * G);
        const vf lo = to_float(q & 15), hi = to_float(q >> 4);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          lo_s[m][l % NC] += lo * x0[m * QK + l];
          hi_s[m][l % NC] += hi * x1[m * QK + l];
        }
      }
      const vf sc0 = to_float(widen<false>(g + 4 * G + 2 * c * G)) * d;
      const vf sc1 = to_float(widen<false>(g + 4 * G + (2 * c + 1) * G)) * d;
      const vf mn0 = to_float(widen<false>(g + 12 * G + 2 * c * G)) * dmin;
      const vf mn1 = to_float(widen<false>(g + 12 * G + (2 * c + 1) * G)) * dmin;
      for (int m = 0; m < M; ++m) {
        vf t0 = lo_s[m][0], t1 = hi_s[m][0];
        for (int i = 1; i < NC; ++i) {
          t0 += lo_s[m][i];
          t1 += hi_s[m][i];
        }
        acc[m] += t0 * sc0 - mn0 * xsum[s0 * M + m] + t1 * sc1 - mn1 * xsum[(s0 + 1) * M + m];
      }
    }
  }
  for (int m = 0; m < M; ++m) std::memcpy(out + m * out_stride, &acc[m], rows * sizeof(float));
}

// Q6_K's quants of one quant position l of 16 rows: elements l, l + 32, l + 64, l + 96 of
// a half super-block, as q - 32. ql: the half's 64 low-bit bytes, qh: its 32 high-bit bytes.
inline void q6k_quants(const uint8_t* ql, const uint8_t* qh, int l, vf q[4]) {
  const vi a = widen<false>(ql + l * G), b = widen<false>(ql + (l + 32) * G), h = widen<false>(qh + l * G);
  q[0] = to_float(((a & 15) | ((h & 3) << 4)) - 32);
  q[1] = to_float(((b & 15) | ((h & 12) << 2)) - 32);
  q[2] = to_float(((a >> 4) | (h & 48)) - 32);
  q[3] = to_float(((b >> 4) | ((h >> 2) & 48)) - 32);
}

// Q6_K: per super-block d at 0, the 16 sub-blocks' int8 scales at 2G, ql at 18G, qh at 146G.
template <int M>
void group_rows_q6k(float* out, int64_t out_stride, const float* xb, const float* /*xsum*/,
                    const uint8_t* g, int64_t k, int rows) {
  constexpr int64_t GB = G * block_bytes<kQ6_K>();
  vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = vf{};
  for (int64_t sb = 0; sb < k / 256; ++sb, g += GB) {
    const vf d = halves(g);
    for (int h = 0; h < 2; ++h) {
      // Elements 128h + 32u + l (u = 0..3): x block sb * 8 + 4h + u, sub-block 8h + 2u + l / 16.
      const float* x = xb + (sb * 8 + 4 * h) * M * QK;
      for (int half = 0; half < 2; ++half) {
        vf s[4][M];
        for (int u = 0; u < 4; ++u)
          for (int m = 0; m < M; ++m) s[u][m] = vf{};
#pragma GCC unroll 4
        for (int l = half * 16; l < half * 16 + 16; ++l) {
          vf q[4];
          q6k_quants(g + 18 * G + 64 * h * G, g + 146 * G + 32 * h * G, l, q);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u)
            for (int m = 0; m < M; ++m) s[u][m] += q[u] * x[(u * M + m) * QK + l];
        }
        for (int u = 0; u < 4; ++u) {
          const vf scale = to_float(widen<true>(g + 2 * G + (8 * h + 2 * u + half) * G)) * d;
          for (int m = 0; m < M; ++m) acc[m] += scale * s[u][m];
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) std::memcpy(out + m * out_stride, &acc[m], rows * sizeof(float));
}

template <int64_t T, int M>
void rows_kernel(float* out, int64_t out_stride, const float* x, const float* xsum, const uint8_t* g, int64_t k,
                 int rows) {
  if constexpr (M > pass_rows<T>()) {
    TORCH_CHECK(false, "unreachable");
  } else if constexpr (T == kQ4_K) {
    group_rows_q4k<M>(out, out_stride, x, xsum, g, k, rows);
  } else if constexpr (T == kQ6_K) {
    group_rows_q6k<M>(out, out_stride, x, xsum, g, k, rows);
  } else {
    group_rows<T, M>(out, out_stride, x, xsum, g, k, rows);
  }
}

// The group's 16 rows as fp32 (or bf16), k-major: scratch[c * ld + r] = W[r0 + r][c].
template <int64_t T, typename O>
void expand_group(O* scratch, const uint8_t* g, int64_t k, int64_t ld) {
  constexpr int64_t GB = G * block_bytes<T>();
  const auto put = [&](int64_t col, const vf& v) { store_vec(scratch + col * ld, v); };
  if constexpr (T == kQ4_K) {
    for (int64_t sb = 0; sb < k / 256; ++sb, g += GB) {
      const vf d = halves(g), dmin = halves(g + 2 * G);
      for (int c = 0; c < 4; ++c) {
        const vf sc0 = to_float(widen<false>(g + 4 * G + 2 * c * G)) * d;
        const vf sc1 = to_float(widen<false>(g + 4 * G + (2 * c + 1) * G)) * d;
        const vf mn0 = to_float(widen<false>(g + 12 * G + 2 * c * G)) * dmin;
        const vf mn1 = to_float(widen<false>(g + 12 * G + (2 * c + 1) * G)) * dmin;
        for (int l = 0; l < 32; ++l) {
          const vi q = widen<false>(g + 20 * G + (c * 32 + l) * G);
          put(sb * 256 + c * 64 + l, to_float(q & 15) * sc0 - mn0);
          put(sb * 256 + c * 64 + 32 + l, to_float(q >> 4) * sc1 - mn1);
        }
      }
    }
  } else if constexpr (T == kQ6_K) {
    for (int64_t sb = 0; sb < k / 256; ++sb, g += GB) {
      const vf d = halves(g);
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          vf q[4];
          q6k_quants(g + 18 * G + 64 * h * G, g + 146 * G + 32 * h * G, l, q);
          for (int u = 0; u < 4; ++u) {
            const vf scale = to_float(widen<true>(g + 2 * G + (8 * h + 2 * u + l / 16) * G)) * d;
            put(sb * 256 + 128 * h + 32 * u + l, scale * q[u]);
          }
        }
    }
  } else {
    for (int64_t b = 0; b < k / QK; ++b, g += GB) {
      const vf d = halves(g);
      vf add = vf{};
      if constexpr (T == kQ4_1) add = halves(g + 2 * G);
      if constexpr (T == kQ4_0) add = d * -8.f;
      for (int j = 0; j < 16; ++j) {
        vf lo, hi;
        quants<T>(g, j, lo, hi);
        put(b * QK + j, lo * d + add);
        put(b * QK + j + 16, hi * d + add);
      }
    }
  }
}

template <int64_t T>
void group_rows_any(float* out, int64_t out_stride, const float* x, const float* xsum, const uint8_t* g,
                    int64_t k, int rows, int64_t m) {
  switch (m) {
    case 1: return rows_kernel<T, 1>(out, out_stride, x, xsum, g, k, rows);
    case 2: return rows_kernel<T, 2>(out, out_stride, x, xsum, g, k, rows);
#if defined(__AVX512F__)
    case 3: return rows_kernel<T, 3>(out, out_stride, x, xsum, g, k, rows);
    case 4: return rows_kernel<T, 4>(out, out_stride, x, xsum, g, k, rows);
    case 5: return rows_kernel<T, 5>(out, out_stride, x, xsum, g, k, rows);
    case 6: return rows_kernel<T, 6>(out, out_stride, x, xsum, g, k, rows);
    case 7: return rows_kernel<T, 7>(out, out_stride, x, xsum, g, k, rows);
    case 8: return rows_kernel<T, 8>(out, out_stride, x, xsum, g, k, rows);
#endif
    default: TORCH_CHECK(false, "unreachable");
  }
}

template <int64_t T>
constexpr int64_t group_bytes(int64_t k) {  // one group of 16 rows
  return k / block_weights<T>() * G * block_bytes<T>();
}

// read(dst, src) copies one block of 32 values of x into fp32 (a bf16 x is widened there).
template <int64_t T, typename X, typename Read>
void quant_linear_type(float* out, const X* x, const uint8_t* w, int64_t m, int64_t n, int64_t k, Read read) {
  constexpr int64_t P = pass_rows<T>();
  const int64_t nb = k / QK, groups = (n + G - 1) / G, gbytes = group_bytes<T>(k);
  // x block-major (32 values a block) per pass of up to P rows (see group_rows), and its
  // block sums.
  const int64_t passes = (m + P - 1) / P;
  std::vector<float> xt(m * k), xsum(m * nb);
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t r0 = p * P, rows = std::min<int64_t>(P, m - r0);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = &xt[r0 * k + (b * rows + r) * QK];
        read(&xt[r0 * k + (b * rows + r) * QK], x + (r0 + r) * k + b * QK);
        float sum = 0.f;
        for (int j = 0; j < QK; ++j) sum += src[j];
        xsum[r0 * nb + b * rows + r] = sum;
      }
  }
  // Rows of x in passes of P, each pass over the same group (still in L1).
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const int rows = static_cast<int>(std::min<int64_t>(G, n - gi * G));
      for (int64_t i = 0; i < m; i += P)
        group_rows_any<T>(out + i * n + gi * G, n, xt.data() + i * k, xsum.data() + i * nb, w + gi * gbytes, k,
                          rows, std::min<int64_t>(P, m - i));
    }
  });
}

template <int64_t T>
void quant_linear_type(float* out, const float* x, const uint8_t* w, int64_t m, int64_t n, int64_t k) {
  quant_linear_type<T>(out, x, w, m, n, k, [](float* dst, const float* src) { std::memcpy(dst, src, QK * sizeof(float)); });
}

// Many rows of x (prefill): expand row groups of W into W^T [k, cols] pieces of about
// kGemmChunkBytes, in x's dtype (fp32, or bf16 for a --dtype bfloat16 model), and multiply
// each with torch's GEMM (bf16: oneDNN's AVX512_BF16 kernels, fp32 accumulation).
template <int64_t T, typename O>
void quant_linear_gemm(at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n, int64_t k) {
  const int64_t groups = (n + G - 1) / G, gbytes = group_bytes<T>(k);
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(groups, kGemmChunkBytes / (k * G * sizeof(O))));
  for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
    const int64_t cg = std::min(chunk, groups - g0), ld = cg * G, cols = std::min(ld, n - g0 * G);
    at::Tensor wt = at::empty({k, ld}, x.options());
    O* wp = wt.data_ptr<O>();
    at::parallel_for(0, cg, 1, [&](int64_t begin, int64_t end) {
      for (int64_t gi = begin; gi < end; ++gi) expand_group<T>(wp + gi * G, w + (g0 + gi) * gbytes, k, ld);
    });
    if (ld == n) {  // one piece, no padded rows
      at::mm_out(out, x, wt);
    } else {
      out.narrow(1, g0 * G, cols).copy_(at::mm(x, wt).narrow(1, 0, cols));
    }
  }
}

// ---- int8 activations (--cpu-activation-quant int8: opt-in, not exact; llama.cpp's trade)
//
// A packed type id ORed with kInt8Activations: the same blocks in the same bytes, laid out
// for AVX-512 VNNI (vpdpbusd multiplies 4 unsigned bytes by 4 signed ones per int32 lane):
// per group block the 16 rows' d (and m), then 64-byte chunks, chunk t holding 4 bytes of
// each row: Q4 quant bytes 4t..4t+3 (low nibbles: elements 4t..4t+3, high: 16+4t..), Q8_0
// elements 4t..4t+3 plus 128 (unsigned). x is rounded per block of 32 to int8 with its own
// scale (dx = max|x| / 127, q = nearest(x / dx)), the block's dot product is exact in int32,
// and per block y += d dx (q_w . q_x) (- 8 or - 128 dx sum(q_x), + m dx sum(q_x)).
constexpr int64_t kInt8Activations = 256;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int64_t T>
void pack_block_vnni(uint8_t* gb, const uint8_t* blk, int r) {
  constexpr int64_t scales = T == kQ4_1 ? 2 : 1, qbytes = T == kQ8_0 ? 32 : 16;
  for (int64_t f = 0; f < scales; ++f) std::memcpy(gb + f * 2 * G + 2 * r, blk + 2 * f, 2);
  uint8_t* dst = gb + 2 * scales * G;
  for (int64_t j = 0; j < qbytes; ++j) {
    const uint8_t q = blk[2 * scales + j];
    dst[j / 4 * 64 + r * 4 + j % 4] = T == kQ8_0 ? static_cast<uint8_t>(q ^ 0x80) : q;
  }
}

// Rows [r0, r0 + rows) of x [m, k] rounded to int8 per block of 32, block-major as the
// fp32 passes lay x out: q[(b * rows + r) * 32 + j], d and s (sum of q) at b * rows + r.
void quantize_rows_int8(const float* x, int64_t k, int64_t rows, int8_t* q, float* d, int32_t* s) {
  const int64_t nb = k / QK;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + r * k + b * QK;
      const __m512 a = _mm512_loadu_ps(src), c = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float dx = amax / 127.f, id = dx != 0.f ? 1.f / dx : 0.f;
      // Round to nearest (even on ties: the default MXCSR mode), |q| <= 127.
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
      int8_t* dst = q + (b * rows + r) * QK;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qc));
      d[b * rows + r] = dx;
      s[b * rows + r] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int64_t T, int M>
void group_rows_vnni(float* out, int64_t out_stride, const int8_t* xq, const float* xd, const int32_t* xs,
                     const uint8_t* g, int64_t nb, int rows) {
  constexpr int64_t GB = G * block_bytes<T>(), Q = T == kQ4_1 ? 4 * G : 2 * G;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += GB, xq += M * QK) {
    __m512i isum[M];
    for (int m = 0; m < M; ++m) isum[m] = _mm512_setzero_si512();
    if constexpr (T == kQ8_0) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_loadu_si512(g + Q + t * 64);
        for (int m = 0; m < M; ++m) isum[m] = _mm512_dpbusd_epi32(isum[m], w, broadcast4(xq + m * QK + 4 * t));
      }
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i w = _mm512_loadu_si512(g + Q + t * 64);
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int m = 0; m < M; ++m) {
          isum[m] = _mm512_dpbusd_epi32(isum[m], lo, broadcast4(xq + m * QK + 4 * t));
          isum[m] = _mm512_dpbusd_epi32(isum[m], hi, broadcast4(xq + m * QK + 16 + 4 * t));
        }
      }
    }
    const vf dv = halves(g);
    __m512 dw;
    std::memcpy(&dw, &dv, sizeof(dw));
    for (int m = 0; m < M; ++m) {
      const float dx = xd[b * M + m];
      const int32_t sx = xs[b * M + m];
      __m512i i = isum[m];
      if constexpr (T == kQ4_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(8 * sx));
      if constexpr (T == kQ8_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(128 * sx));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[m]);
      if constexpr (T == kQ4_1) {
        const vf mv = halves(g + 2 * G);
        __m512 mw;
        std::memcpy(&mw, &mv, sizeof(mw));
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(sx)), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    float tmp[G];
    _mm512_storeu_ps(tmp, acc[m]);
    std::memcpy(out + m * out_stride, tmp, rows * sizeof(float));
  }
}

template <int64_t T>
void quant_linear_vnni(float* out, const float* x, const uint8_t* w, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t P = kMaxRegRows;
  const int64_t nb = k / QK, groups = (n + G - 1) / G, gbytes = group_bytes<T>(k);
  std::vector<int8_t> xq(m * k);
  std::vector<float> xd(m * nb);
  std::vector<int32_t> xs(m * nb);
  at::parallel_for(0, (m + P - 1) / P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r0 = p * P, rows = std::min<int64_t>(P, m - r0);
      quantize_rows_int8(x + r0 * k, k, rows, xq.data() + r0 * k, xd.data() + r0 * nb, xs.data() + r0 * nb);
    }
  });
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const int rows = static_cast<int>(std::min<int64_t>(G, n - gi * G));
      for (int64_t i = 0; i < m; i += P) {
        float* o = out + i * n + gi * G;
        const int8_t* q = xq.data() + i * k;
        const float* d = xd.data() + i * nb;
        const int32_t* s = xs.data() + i * nb;
        const uint8_t* wg = w + gi * gbytes;
        switch (std::min<int64_t>(P, m - i)) {
          case 1: group_rows_vnni<T, 1>(o, n, q, d, s, wg, nb, rows); break;
          case 2: group_rows_vnni<T, 2>(o, n, q, d, s, wg, nb, rows); break;
          case 3: group_rows_vnni<T, 3>(o, n, q, d, s, wg, nb, rows); break;
          case 4: group_rows_vnni<T, 4>(o, n, q, d, s, wg, nb, rows); break;
          case 5: group_rows_vnni<T, 5>(o, n, q, d, s, wg, nb, rows); break;
          case 6: group_rows_vnni<T, 6>(o, n, q, d, s, wg, nb, rows); break;
          case 7: group_rows_vnni<T, 7>(o, n, q, d, s, wg, nb, rows); break;
          default: group_rows_vnni<T, 8>(o, n, q, d, s, wg, nb, rows); break;
        }
      }
    }
  });
}
#endif

// The base type of an int8-activation id, after checking this build can run it.
int64_t int8_base_type(int64_t type) {
  const int64_t base = type & ~kInt8Activations;
  TORCH_CHECK(base == kQ4_0 || base == kQ4_1 || base == kQ8_0, "int8 activations: ggml type ", base,
              " is not supported (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  TORCH_CHECK(false, "int8 activations need a CPU with AVX-512 VNNI (and this build for it)");
#endif
  return base;
}

// Calls fn(std::integral_constant<int64_t, T>{}) for a supported ggml type, else fails.
template <typename Fn>
auto with_type(int64_t type, Fn&& fn) {
  using std::integral_constant;
  switch (type) {
    case kQ8_0: return fn(integral_constant<int64_t, kQ8_0>{});
    case kQ4_0: return fn(integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return fn(integral_constant<int64_t, kQ4_1>{});
    case kQ4_K: return fn(integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return fn(integral_constant<int64_t, kQ6_K>{});
    default:
      TORCH_CHECK(false, "ggml type ", type,
                  " is not supported here (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
  }
}

// Shape checks shared by the ops: packed is [ceil(n / 16), k / block weights * 16 * block bytes].
void check_packed(const at::Tensor& packed, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed weight: contiguous uint8 [groups, bytes] from quant_pack");
  if (type & kInt8Activations) type = int8_base_type(type);  // the same bytes as the base type
  with_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    TORCH_CHECK(k > 0 && k % block_weights<T>() == 0, "K must be a positive multiple of ", block_weights<T>(),
                " for ggml type ", T, ", got ", k);
    TORCH_CHECK(n > 0 && packed.size(0) == (n + G - 1) / G && packed.size(1) == group_bytes<T>(k), "packed weight of ",
                n, " x ", k, " in type ", T, " must be [", (n + G - 1) / G, ", ", group_bytes<T>(k), "], got ",
                packed.sizes());
  });
}

void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t n) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && out.scalar_type() == x.scalar_type(),
              "quant_linear: fp32 or bf16 x, and out of the same dtype");
  TORCH_CHECK(!(bf16 && (type & kInt8Activations)), "quant_linear: int8 activations take fp32 x");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              "quant_linear: contiguous 2-D x and out");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed(packed, type, n, k);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_linear: out must be [", m, ", ", n, "]");
  if (m == 0) return;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (type & kInt8Activations) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const float* xp = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    switch (type & ~kInt8Activations) {
      case kQ8_0: return quant_linear_vnni<kQ8_0>(o, xp, wp, m, n, k);
      case kQ4_0: return quant_linear_vnni<kQ4_0>(o, xp, wp, m, n, k);
      case kQ4_1: return quant_linear_vnni<kQ4_1>(o, xp, wp, m, n, k);
    }
#endif
    return;  // unreachable: check_packed checked the type
  }
  with_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    // The register kernels split the work by 4 groups of 16 output rows a task: a matrix
    // too narrow to give every thread a task (many cores) takes the GEMM from 64 rows.
    const bool narrow = (n + 4 * G - 1) / (4 * G) < at::get_num_threads();
    if (m >= gemm_rows<T>(bf16) || (m >= 64 && narrow)) {
      if (bf16) {
        quant_linear_gemm<T, c10::BFloat16>(out, x, wp, n, k);
      } else {
        quant_linear_gemm<T, float>(out, x, wp, n, k);
      }
    } else if (!bf16) {
      quant_linear_type<T>(out.data_ptr<float>(), x.data_ptr<float>(), wp, m, n, k);
    } else {  // a few bf16 rows: widened to fp32 (exact), multiplied as fp32, rounded back
      std::vector<float> of(m * n);
      quant_linear_type<T>(of.data(), x.data_ptr<c10::BFloat16>(), wp, m, n, k,
                           [](float* dst, const c10::BFloat16* src) {
                             for (int j = 0; j < QK; j += W) store_vec(dst + j, load_vec(src + j));
                           });
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
      int64_t i = 0;
      for (; i + W <= m * n; i += W) store_vec(o + i, load_vec(of.data() + i));
      for (; i < m * n; ++i) o[i] = static_cast<c10::BFloat16>(of[i]);  // c10 rounds alike
    }
  });
}

// One GGUF block of one row into its place in an interleaved group block (row r of 16).
template <int64_t T>
void pack_block(uint8_t* gb, const uint8_t* blk, int r) {
  if constexpr (T == kQ4_K) {  // d, dmin, scales[12] (6-bit scales and mins), qs[128]
    std::memcpy(gb + 2 * r, blk, 2);
    std::memcpy(gb + 2 * G + 2 * r, blk + 2, 2);
    const uint8_t* q = blk + 4;
    for (int j = 0; j < 8; ++j) {  // ggml's get_scale_min_k4
      const uint8_t sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
      const uint8_t mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      gb[4 * G + j * G + r] = sc;
      gb[12 * G + j * G + r] = mn;
    }
    for (int j = 0; j < 128; ++j) gb[20 * G + j * G + r] = blk[16 + j];
  } else if constexpr (T == kQ6_K) {  // ql[128], qh[64], scales[16], d
    std::memcpy(gb + 2 * r, blk + 208, 2);
    for (int j = 0; j < 16; ++j) gb[2 * G + j * G + r] = blk[192 + j];
    for (int j = 0; j < 128; ++j) gb[18 * G + j * G + r] = blk[j];
    for (int j = 0; j < 64; ++j) gb[146 * G + j * G + r] = blk[128 + j];
  } else {  // d, (Q4_1: m), quants
    constexpr int64_t scales = T == kQ4_1 ? 2 : 1, qbytes = block_bytes<T>() - 2 * scales;
    for (int64_t f = 0; f < scales; ++f) std::memcpy(gb + f * 2 * G + 2 * r, blk + 2 * f, 2);
    for (int64_t j = 0; j < qbytes; ++j) gb[2 * scales * G + j * G + r] = blk[2 * scales + j];
  }
}

template <int64_t T>
void pack_one(bool int8, uint8_t* gb, const uint8_t* blk, int r) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ8_0) {
    if (int8) return pack_block_vnni<T>(gb, blk, r);
  }
#endif
  pack_block<T>(gb, blk, r);
}

// GGUF rows [n, k / block weights * GGUF block bytes] -> interleaved groups (the last
// group zero-padded).
at::Tensor quant_pack(const at::Tensor& blocks, int64_t type, int64_t k) {
  const bool int8 = type & kInt8Activations;
  if (int8) type = int8_base_type(type);
  return with_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value, BW = block_weights<T>(), bb = gguf_block_bytes<T>();
    TORCH_CHECK(k > 0 && k % BW == 0, "K must be a positive multiple of ", BW, " for ggml type ", T, ", got ", k);
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == k / BW * bb,
                "GGUF blocks of K = ", k, " must be uint8 [rows, ", k / BW * bb, "], got ", blocks.sizes());
    const at::Tensor src = blocks.contiguous();
    const int64_t n = src.size(0), nb = k / BW, groups = (n + G - 1) / G;
    at::Tensor packed = at::zeros({groups, group_bytes<T>(k)}, src.options());
    const uint8_t* s = src.data_ptr<uint8_t>();
    uint8_t* p = packed.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
      for (int64_t gi = begin; gi < end; ++gi)
        for (int64_t b = 0; b < nb; ++b)
          for (int r = 0; r < G && gi * G + r < n; ++r)
            pack_one<T>(int8, p + (gi * nb + b) * G * block_bytes<T>(), s + (gi * G + r) * nb * bb + b * bb, r);
    });
    return packed;
  });
}

// Rows `ids` of the packed weight as fp32 [len(ids), k] (embedding lookups).
template <int64_t T>
void dequant_rows_type(float* out, const uint8_t* w, const int64_t* ids, int64_t count, int64_t k) {
  constexpr int64_t GB = G * block_bytes<T>();
  const int64_t nb = k / block_weights<T>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = ids[i] % G;
      const uint8_t* g = w + ids[i] / G * nb * GB;
      float* o = out + i * k;
      for (int64_t b = 0; b < nb; ++b, g += GB, o += block_weights<T>()) {
        const float d = half_at(g + 2 * r);
        if constexpr (T == kQ4_K) {
          const float dmin = half_at(g + 2 * G + 2 * r);
          for (int c = 0; c < 4; ++c) {
            const float d0 = d * g[4 * G + 2 * c * G + r], d1 = d * g[4 * G + (2 * c + 1) * G + r];
            const float m0 = dmin * g[12 * G + 2 * c * G + r], m1 = dmin * g[12 * G + (2 * c + 1) * G + r];
            for (int l = 0; l < 32; ++l) {
              const uint8_t q = g[20 * G + (c * 32 + l) * G + r];
              o[c * 64 + l] = d0 * (q & 15) - m0;
              o[c * 64 + 32 + l] = d1 * (q >> 4) - m1;
            }
          }
        } else if constexpr (T == kQ6_K) {
          for (int e = 0; e < 256; ++e) {
            const int h = e / 128, u = e % 128 / 32, l = e % 32;
            const uint8_t a = g[18 * G + (64 * h + l + (u & 1) * 32) * G + r];
            const uint8_t hb = g[146 * G + (32 * h + l) * G + r];
            const int q = ((u < 2 ? a & 15 : a >> 4) | (((hb >> (2 * u)) & 3) << 4)) - 32;
            o[e] = d * static_cast<int8_t>(g[2 * G + (e / 16) * G + r]) * q;
          }
        } else {
          const uint8_t* q = g + quants_at<T>() + r;
          if constexpr (T == kQ8_0) {
            for (int j = 0; j < QK; ++j) o[j] = d * static_cast<int8_t>(q[j * G]);
          } else {
            const float add = T == kQ4_1 ? half_at(g + 2 * G + 2 * r) : -8.f * d;
            for (int j = 0; j < 16; ++j) {
              o[j] = (q[j * G] & 15) * d + add;
              o[j + 16] = (q[j * G] >> 4) * d + add;
            }
          }
        }
      }
    }
  });
}

at::Tensor quant_dequant_rows(const at::Tensor& packed, int64_t type, int64_t n, int64_t k, const at::Tensor& ids) {
  check_packed(packed, type, n, k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids: int64 [count]");
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.size(0); ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "row id ", ip[i], " out of [0, ", n, ")");
  at::Tensor out = at::empty({idc.size(0), k}, packed.options().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  with_type(type, [&](auto t) { dequant_rows_type<decltype(t)::value>(o, wp, ip, idc.size(0), k); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor packed, int type, int n) -> ()");
  m.def("quant_pack(Tensor blocks, int type, int k) -> Tensor");
  m.def("quant_dequant_rows(Tensor packed, int type, int n, int k, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_dequant_rows", &quant_dequant_rows);
}
