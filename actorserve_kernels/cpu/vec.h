// Shared by the CPU kernels: 16-float vectors (GCC vector extensions, so the compiler
// picks AVX-512, AVX2 or SSE for the machine) and a 16-way horizontal reduction.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <type_traits>

namespace {

constexpr int W = 16;  // floats per vector, and positions per pass-1 tile
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int vi __attribute__((vector_size(W * sizeof(int))));

typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

template <typename scalar_t>
inline vf load_vec(const scalar_t* p) {
  vf v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // the high half of a float
    vh h;
    std::memcpy(&h, p, sizeof(h));
    const vi bits = __builtin_convertvector(h, vi) << 16;
    std::memcpy(&v, &bits, sizeof(v));
  } else {
    for (int j = 0; j < W; ++j) v[j] = static_cast<float>(p[j]);
  }
  return v;
}

// 16 floats stored as they are, or rounded to bf16 (to nearest even, as c10 rounds; NaN
// stays NaN).
inline void store_vec(float* p, const vf& v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_vec(c10::BFloat16* p, const vf& v) {
  typedef unsigned vu __attribute__((vector_size(W * sizeof(unsigned))));
  vu bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16;
  const vu quiet = (bits >> 16) | 0x40;  // a NaN's top half, kept a NaN
  const vh h = __builtin_convertvector(v != v ? quiet : rounded, vh);
  std::memcpy(p, &h, sizeof(h));
}

// fn(float{}) or fn(c10::BFloat16{}) by the dtype of the model's activations (checked
// before: fp32 or bf16).
template <typename Fn>
inline void with_dtype(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kBFloat16) {
    fn(c10::BFloat16{});
  } else {
    fn(float{});
  }
}

// Lanes j of the result = sum of the lanes of a[j], for 16 vectors a[0..15]: a tree of
// folds, each adding the two halves of pairs of vectors (15 adds, 30 shuffles in all).
inline vf sum16(vf a[W]) {
  vf b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(a[2 * j], a[2 * j + 1], vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  // b[j]: lanes 0-7 partials of a[2j], 8-15 of a[2j+1].
  for (int j = 0; j < 4; ++j)
    c[j] = __builtin_shuffle(b[2 * j], b[2 * j + 1], vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(b[2 * j], b[2 * j + 1], vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  // c[j]: 4 lanes each of a[4j], a[4j+2], a[4j+1], a[4j+3].
  for (int j = 0; j < 2; ++j)
    d[j] = __builtin_shuffle(c[2 * j], c[2 * j + 1], vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(c[2 * j], c[2 * j + 1], vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  // d[j]: pairs of a[8j + {0, 4, 2, 6, 1, 5, 3, 7}].
  vf e = __builtin_shuffle(d[0], d[1], vi{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
         __builtin_shuffle(d[0], d[1], vi{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  // e: a[{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}]; put them in order.
  return __builtin_shuffle(e, vi{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

// exp of every lane, ~1 ulp for fp32 (Cephes' expf: exp(x) = 2^n * exp(r) with
// |r| <= ln2/2 and a degree-6 polynomial). glibc's vector expf is only declared under
// -ffast-math, which also assumes no infinities; this keeps IEEE semantics elsewhere.
inline vf exp_vec(vf x) {
  const vf hi = x > 88.3762626647949f ? vf{} + 88.3762626647949f : x;
  x = hi < -87.3365478515625f ? vf{} - 87.3365478515625f : hi;
  const vf round_magic = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + round_magic) - round_magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace
