// Linear layers over GGUF-quantized weights, dequantized in registers: y = x W^T.
//
// W stays as the GGUF file has it: each row of N is K / 32 blocks of one ggml type
// (Q8_0: an fp16 scale d and 32 int8, w = d q; Q4_0: d and 32 4-bit q, w = d (q - 8);
// Q4_1: d, an fp16 minimum m and 32 4-bit q, w = d q + m; element j of a Q4 block is the
// low nibble of byte j, element j + 16 the high one). A block is expanded into two
// 16-float vectors and multiplied into fp32 accumulators, so the result is the
// dequantized weight's fp32 product up to summation order, while the weight is read at
// 4.5 to 8.5 bits per value: a decode step, bound by reading the weights, reads 4-7x
// fewer bytes than with fp32 weights.
//
// Like small_linear, 16 / M weight rows are done at once (M x 16 / M accumulators, one
// sum16 at the end). Rows of x beyond 16 are done 16 at a time; each pass dequantizes
// the weight again, so this is a kernel for decode batches, not for long prefills.
// Still compute-bound (the dequantization), not bandwidth-bound: bench/quant_linear.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

constexpr int QK = 32;
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
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
constexpr int64_t block_bytes() {
  return T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : 20;
}

// The 32 weights of one block: elements 0-15 in lo, 16-31 in hi.
template <int64_t T>
inline void dequant(const uint8_t* b, vf& lo, vf& hi) {
  const float d = half_at(b);
  if constexpr (T == kQ8_0) {
    lo = __builtin_convertvector(widen<true>(b + 2), vf) * d;
    hi = __builtin_convertvector(widen<true>(b + 18), vf) * d;
  } else {
    // x86 has no byte shifts: widen to int32 lanes, then split the nibbles
    const vi qi = widen<false>(b + (T == kQ4_1 ? 4 : 2));
    lo = __builtin_convertvector(qi & 15, vf);
    hi = __builtin_convertvector(qi >> 4, vf);
    if constexpr (T == kQ4_0) {
      lo = (lo - 8.f) * d;
      hi = (hi - 8.f) * d;
    } else {
      const float m = half_at(b + 2);
      lo = lo * d + m;
      hi = hi * d + m;
    }
  }
}

template <int64_t T, int M>
void quant_rows(float* out, int64_t out_stride, const float* x, const uint8_t* w, int64_t n, int64_t k) {
  constexpr int R = W / M;  // weight rows per task
  constexpr int64_t B = block_bytes<T>();
  const int64_t row_bytes = k / QK * B;
  const int64_t num_tasks = (n + R - 1) / R;
  at::parallel_for(0, num_tasks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * R;
      const int rows = static_cast<int>(std::min<int64_t>(R, n - r0));
      vf acc[W] = {};
      for (int64_t c = 0; c < k; c += QK) {
        vf xlo[M], xhi[M];
        for (int m = 0; m < M; ++m) {
          std::memcpy(&xlo[m], x + m * k + c, sizeof(vf));
          std::memcpy(&xhi[m], x + m * k + c + W, sizeof(vf));
        }
        for (int r = 0; r < R; ++r) {
          if (r < rows) {
            vf lo, hi;
            dequant<T>(w + (r0 + r) * row_bytes + c / QK * B, lo, hi);
            for (int m = 0; m < M; ++m) acc[m * R + r] += xlo[m] * lo + xhi[m] * hi;
          }
        }
      }
      vf sums = sum16(acc);  // lane m * R + r = out[m][r0 + r]
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) out[m * out_stride + r0 + r] = sums[m * R + r];
    }
  });
}

template <int64_t T>
void quant_linear_type(float* out, const float* x, const uint8_t* w, int64_t m, int64_t n, int64_t k) {
  int64_t i = 0;
  for (; i + 16 <= m; i += 16) quant_rows<T, 16>(out + i * n, n, x + i * k, w, n, k);
  for (int rest = 8; rest >= 1; rest /= 2) {
    if (m - i >= rest) {
      switch (rest) {
        case 8: quant_rows<T, 8>(out + i * n, n, x + i * k, w, n, k); break;
        case 4: quant_rows<T, 4>(out + i * n, n, x + i * k, w, n, k); break;
        case 2: quant_rows<T, 2>(out + i * n, n, x + i * k, w, n, k); break;
        default: quant_rows<T, 1>(out + i * n, n, x + i * k, w, n, k); break;
      }
      i += rest;
    }
  }
}

void quant_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& qweight, int64_t type) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "quant_linear: fp32 x and out");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "quant_linear: the weight is GGUF blocks (uint8)");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && qweight.is_contiguous(), "contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(k % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "shape mismatch");
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (type) {
    case kQ8_0:
      TORCH_CHECK(qweight.size(1) == k / QK * 34, "Q8_0 rows are K / 32 * 34 bytes");
      return quant_linear_type<kQ8_0>(o, xp, wp, m, n, k);
    case kQ4_0:
      TORCH_CHECK(qweight.size(1) == k / QK * 18, "Q4_0 rows are K / 32 * 18 bytes");
      return quant_linear_type<kQ4_0>(o, xp, wp, m, n, k);
    case kQ4_1:
      TORCH_CHECK(qweight.size(1) == k / QK * 20, "Q4_1 rows are K / 32 * 20 bytes");
      return quant_linear_type<kQ4_1>(o, xp, wp, m, n, k);
    default: TORCH_CHECK(false, "quant_linear: ggml type ", type, " is not supported (Q4_0, Q4_1, Q8_0)");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, int type) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) { m.impl("quant_linear", &quant_linear); }
