// Paged attention over the KV cache in place, for CPUs: one query token per row.
//
// Each output row is one query token of a varlen batch: it attends to the first
// ctx_lens[i] positions of request reqs[i], read through that request's row of the
// block table straight from the paged cache. Nothing is gathered into a contiguous
// copy first, which is what the SDPA path must do and what dominates its decode step.
//
// One task per row, so a row's K/V slots are read front to back, all KV heads at once
// (per-(row, head) tasks read a third of every slot and streamed at a third of the
// bandwidth); with fewer rows than threads, rows are cut into parts (see attend_rows). Two passes instead of an online softmax: all scores of a row fit in
// L1/L2. Both passes walk tiles of 16 positions, one KV head's whole GQA group at a
// time, so a K or V row is loaded once for all the query heads that read it. Pass 1
// reduces a tile's 16 dot products per head with one shuffle tree instead of 16
// horizontal sums (the sums were most of the instructions); pass 2 keeps the group's
// accumulators in registers.
//
// Vectors are GCC vector extensions (16 floats), so the code is portable and the
// compiler picks AVX-512, AVX2 or SSE for the machine (-march=native).
//
// Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
// query/out: [T, num_heads, head_dim] with a contiguous last dimension (any other
// strides, so a view into a fused qkv projection works). Accumulation is fp32 for
// every cache dtype.
//
// Quantized caches (``--kv-cache-dtype``, actorserve_kernels/kv_quant.py) are read as
// stored and dequantized in registers, each K or V element to exactly the fp32 value
// ``kv_quant.dequantize`` gives (float(stored) * scale, one rounding), so the op on a
// quantized cache computes what it computes on a plain fp32 cache holding those values:
// - fp8 e4m3fn / e5m2 (one scale per layer for K and one for V): a code becomes the fp16
//   with the same sign, exponent and mantissa bits (e5m2 is the top byte of an fp16;
//   e4m3fn's code shifted into place is the fp16 of its value / 256, denormals included,
//   and its NaN codes get the fp16 NaN exponent), converted by F16C (vcvtph2ps), then
//   multiplied by the layer scale (x 256 for e4m3fn: exact, so still one rounding).
//   NaN and infinity come out as torch's conversion gives them.
// - int8 [.., head_dim + 4]: each (token, head) row is head_dim int8 values and then its
//   fp32 scale; sign-extended, converted, multiplied by the row's scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

// 16 fp16 bit patterns to floats: exact, denormals included, a NaN stays a NaN (quieted,
// its payload kept, as torch's conversion does).
inline vf half_bits_to_float(const vh& h) {
  vf r;
#if defined(__AVX512F__)
  __m256i x;
  std::memcpy(&x, &h, sizeof(x));
  const __m512 f = _mm512_cvtph_ps(x);
  std::memcpy(&r, &f, sizeof(r));
#elif defined(__F16C__)
  __m128i lo, hi;
  std::memcpy(&lo, &h, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&h) + sizeof(lo), sizeof(hi));
  const __m256 a = _mm256_cvtph_ps(lo), b = _mm256_cvtph_ps(hi);
  std::memcpy(&r, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(a), &b, sizeof(b));
#else
  for (int j = 0; j < W; ++j) r[j] = static_cast<float>(c10::Half(h[j], c10::Half::from_bits()));
#endif
  return r;
}

// 16 bytes, each in the high byte of a 16-bit lane (the low byte zero).
inline vh bytes_to_high_halves(const uint8_t* p) {
  vh h;
#if defined(__AVX2__)
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  std::memcpy(&h, &x, sizeof(h));
#else
  for (int j = 0; j < W; ++j) h[j] = static_cast<uint16_t>(p[j] << 8);
#endif
  return h;
}

// fp8 e5m2 codes -> floats: each code is the top byte of the fp16 of the same value.
inline vf fp8_e5m2_to_float(const uint8_t* p) { return half_bits_to_float(bytes_to_high_halves(p)); }

// fp8 e4m3fn codes -> floats / 256: sign s, exponent e (bias 7), mantissa m as the fp16
// s | e << 10 | m << 7 (bias 15: the value / 2^8; an e4m3 denormal, e = 0, is an fp16
// denormal of the same mantissa, so it is exact too); the NaN codes (e = 15, m = 7) get
// the fp16 exponent 31, so they stay NaN with torch's payload (0x7ff00000, signed).
// A code sign-extended to 16 bits and shifted left by 7 (x) has the sign in bits 15 and
// 14 and e, m in bits 13..7; t = x + 0x80 carries into bit 14 exactly when e, m are all
// ones, so bit 14 of x ^ t is the NaN flag: h = x in bits 15, 13..7, x ^ t elsewhere (the
// low bits of both are 0): h = x ^ (t & ~keep).
inline vf fp8_e4m3fn_to_float_div256(const uint8_t* p) {
  typedef int16_t vs __attribute__((vector_size(W * sizeof(int16_t))));
  vs x;
#if defined(__AVX2__)
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&x, &v, sizeof(x));
#else
  for (int j = 0; j < W; ++j) x[j] = static_cast<int8_t>(p[j]);
#endif
  x = x << 7;
  const vs t = x + 0x80;
  constexpr int16_t keep = static_cast<int16_t>(0xBF80);  // bits 15, 13..7 from x
  const vs h = x ^ (t & ~keep);
  vh bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return half_bits_to_float(bits);
}

// 16 int8 values to floats.
inline vf int8_to_float(const int8_t* p) {
  vi x;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&x, &v, sizeof(x));
#elif defined(__AVX2__)
  const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&x, &a, sizeof(a));
  std::memcpy(reinterpret_cast<char*>(&x) + sizeof(a), &b, sizeof(b));
#else
  for (int j = 0; j < W; ++j) x[j] = p[j];
#endif
  return __builtin_convertvector(x, vf);
}

// How a cache row's elements become floats. A row is the head_dim values of one (token, KV
// head), then kScaleBytes; ``row_scale`` is what its values are multiplied by (from the
// row itself, or the layer's scale ``layer`` as the call passes it to ``attend_rows``),
// ``load`` 16 of them, times that scale.
template <typename scalar_t>
struct PlainKV {  // the model's dtype: the values themselves
  using elem_t = scalar_t;
  static constexpr int kScaleBytes = 0;
  static constexpr float kLayerFactor = 1.f;
  template <int D>
  static float row_scale(const elem_t*, float layer) {
    return layer;
  }
  static vf load(const elem_t* p, float) { return load_vec(p); }
};

struct Fp8E4M3KV {
  using elem_t = uint8_t;
  static constexpr int kScaleBytes = 0;
  static constexpr float kLayerFactor = 256.f;  // the conversion gives the value / 256
  template <int D>
  static float row_scale(const elem_t*, float layer) {
    return layer;
  }
  static vf load(const elem_t* p, float s) { return fp8_e4m3fn_to_float_div256(p) * s; }
};

struct Fp8E5M2KV {
  using elem_t = uint8_t;
  static constexpr int kScaleBytes = 0;
  static constexpr float kLayerFactor = 1.f;
  template <int D>
  static float row_scale(const elem_t*, float layer) {
    return layer;
  }
  static vf load(const elem_t* p, float s) { return fp8_e5m2_to_float(p) * s; }
};

struct Int8KV {
  using elem_t = int8_t;
  static constexpr int kScaleBytes = 4;  // the row's fp32 scale after its values
  static constexpr float kLayerFactor = 1.f;
  template <int D>
  static float row_scale(const elem_t* row, float) {
    float s;
    std::memcpy(&s, row + D, sizeof(s));
    return s;
  }
  static vf load(const elem_t* p, float s) { return int8_to_float(p) * s; }
};

// Blocks sit at random places in the cache, and the hardware prefetcher stops at page
// boundaries, so a row streaming block after block from DRAM stalls at each one: ask
// for the slots of tile t0 + ahead while tile t0 is being computed: every cache line of
// the row_elems elements at each slot (int8 rows of head_dim + 4 bytes do not start on a
// line).
template <typename elem_t>
inline void prefetch_tile(const elem_t* base, const int64_t* slot, int64_t from, int64_t to,
                          int64_t row_elems) {
  const int64_t bytes = row_elems * int64_t(sizeof(elem_t));
  for (int64_t t = from; t < to; ++t) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(base + slot[t]);
    for (uintptr_t line = p & ~uintptr_t(63); line < p + bytes; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 1);
  }
}

// Pass-1 tile: scores of the G query heads that share one KV head against positions
// slot[0..n) (n <= W), so each K row is loaded once for the whole group.
template <int G, int C, typename KV>
inline void tile_scores(const vf* q, const typename KV::elem_t* k_head, const int64_t* slot, int n,
                        float* scores, int64_t head_stride, float layer_scale) {
  vf a[G][W];
  for (int j = 0; j < W; ++j) {
    if (j < n) {
      const typename KV::elem_t* k = k_head + slot[j];
      const float s = KV::template row_scale<C * W>(k, layer_scale);
      vf kv[C];
      for (int c = 0; c < C; ++c) kv[c] = KV::load(k + c * W, s);
      for (int g = 0; g < G; ++g) {
        vf acc = q[g * C] * kv[0];
        for (int c = 1; c < C; ++c) acc += q[g * C + c] * kv[c];
        a[g][j] = acc;
      }
    } else {
      for (int g = 0; g < G; ++g) a[g][j] = vf{};
    }
  }
  for (int g = 0; g < G; ++g) {
    vf sum = sum16(a[g]);
    std::memcpy(scores + g * head_stride, &sum, sizeof(sum));
  }
}

// Pass-2 tile: acc[g] += sum_j p[g][j] * v_j for the G heads of one KV head, the
// accumulators in registers and each V row loaded once.
template <int G, int C, typename KV>
inline void tile_accumulate(vf* acc, const float* p, int64_t head_stride, const typename KV::elem_t* v_head,
                            const int64_t* slot, int n, float layer_scale) {
  vf a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = acc[g * C + c];
  for (int j = 0; j < n; ++j) {
    const typename KV::elem_t* v = v_head + slot[j];
    const float s = KV::template row_scale<C * W>(v, layer_scale);
    vf vv[C];
    for (int c = 0; c < C; ++c) vv[c] = KV::load(v + c * W, s);
    for (int g = 0; g < G; ++g) {
      const float pg = p[g * head_stride + j];
      for (int c = 0; c < C; ++c) a[g][c] += pg * vv[c];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g * C + c] = a[g][c];
}

// Calls fn(std::integral_constant<int, G>{}, g0) to handle heads g0 .. g0 + G - 1 of a KV
// head's group with code unrolled for G: the whole group at once for the group sizes of
// common models, one head at a time otherwise.
template <typename Fn>
inline void for_group(int64_t group, Fn&& fn) {
  using std::integral_constant;
  switch (group) {
    case 1: return fn(integral_constant<int, 1>{}, 0);
    case 2: return fn(integral_constant<int, 2>{}, 0);
    case 3: return fn(integral_constant<int, 3>{}, 0);
    case 4: return fn(integral_constant<int, 4>{}, 0);
    case 8: return fn(integral_constant<int, 8>{}, 0);
    default:
      for (int64_t g = 0; g < group; ++g) fn(integral_constant<int, 1>{}, g);
  }
}

// A call's tensors, and the attention of part of one row: some of its KV heads over some
// of its positions.
template <typename scalar_t, typename KV, int D>
struct RowAttention {
  using elem_t = typename KV::elem_t;
  static constexpr int C = D / W;                    // vectors per head
  static constexpr int64_t R = D + KV::kScaleBytes;  // cache elements per (token, head) row
  const scalar_t* q_base;
  const elem_t *k_base, *v_base;
  scalar_t* o_base;
  const int32_t* bt_base;
  const int64_t *rows, *reqs, *ctx_lens;
  int64_t num_heads, num_kv_heads, group, block_size, tok_stride, q_stride0, q_stride1, o_stride0, o_stride1,
      bt_stride;
  int block_shift;
  float scale, k_scale, v_scale;  // k_scale/v_scale: the layer's (fp8), times KV::kLayerFactor

  struct Scratch {
    std::vector<vf> q;
    std::vector<float> scores;
    std::vector<int64_t> slot;  // element offset of each position's cache slot
  };

  // Row i's query heads of KV heads [kv0, kv1) over positions [ta, tb): acc[h] = the
  // unnormalised sum of exp(s - m[h]) v (C vectors per head), m[h] = the head's highest
  // score there, l[h] = its sum of exp(s - m[h]).
  void part(int64_t i, int64_t kv0, int64_t kv1, int64_t ta, int64_t tb, Scratch& s, vf* acc, float* m,
            float* l) const {
    const int64_t len = tb - ta, padded = (len + W - 1) / W * W;
    const int64_t h0 = kv0 * group, nh = (kv1 - kv0) * group;
    const int32_t* table = bt_base + reqs[i] * bt_stride;
    s.q.resize(nh * C);
    s.scores.resize(nh * padded);
    s.slot.resize(padded);
    int64_t* slot = s.slot.data();
    float* scores = s.scores.data();
    for (int64_t t = 0; t < len; ++t) {
      const int64_t p = ta + t;
      slot[t] = ((int64_t(table[p >> block_shift]) << block_shift) + (p & (block_size - 1))) * tok_stride;
    }
    for (int64_t h = 0; h < nh; ++h)
      for (int c = 0; c < C; ++c)
        s.q[h * C + c] = load_vec(q_base + rows[i] * q_stride0 + (h0 + h) * q_stride1 + c * W) * scale;

    // Pass 1: scores[h][t] = q_h . k_t, W positions at a time. Prefetches cover only this
    // part's KV heads of each slot.
    constexpr int64_t ahead = 4 * W;
    const elem_t *k_part = k_base + kv0 * R, *v_part = v_base + kv0 * R;
    const int64_t part_elems = (kv1 - kv0) * R;
    prefetch_tile(k_part, slot, 0, std::min(ahead, len), part_elems);
    prefetch_tile(v_part, slot, 0, std::min(ahead, len), part_elems);
    for (int64_t t0 = 0; t0 < len; t0 += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, len - t0));
      // K for pass 1 and, into L2, V for pass 2: twice the requests in flight.
      prefetch_tile(k_part, slot, std::min(t0 + ahead, len), std::min(t0 + ahead + W, len), part_elems);
      prefetch_tile(v_part, slot, std::min(t0 + ahead, len), std::min(t0 + ahead + W, len), part_elems);
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        for_group(group, [&](auto heads, int64_t g0) {
          const int64_t h = (kvh - kv0) * group + g0;
          tile_scores<decltype(heads)::value, C, KV>(s.q.data() + h * C, k_base + kvh * R, slot + t0, n,
                                                     scores + h * padded + t0, padded, k_scale);
        });
      }
    }
    // Softmax numerators per query head; the caller divides by l.
    for (int64_t h = 0; h < nh; ++h) {
      float* sh = scores + h * padded;
      float mh = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < len; ++t) mh = std::max(mh, sh[t]);
      vf vsum = {};
      int64_t t = 0;
      for (; t + W <= len; t += W) {
        const vf e = exp_vec(load_vec(sh + t) - mh);
        std::memcpy(sh + t, &e, sizeof(e));
        vsum += e;
      }
      float sum = 0.f;
      for (int j = 0; j < W; ++j) sum += vsum[j];
      for (; t < len; ++t) {
        sh[t] = std::exp(sh[t] - mh);
        sum += sh[t];
      }
      m[h] = mh;
      l[h] = sum;
    }
    // Pass 2: acc_h = sum_t p[h][t] * v_t, W positions at a time, so a tile of V stays
    // in L1 while every head reads it; a head's accumulator lives in registers per tile.
    std::fill(acc, acc + nh * C, vf{});
    for (int64_t t0 = 0; t0 < len; t0 += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, len - t0));
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
        for_group(group, [&](auto heads, int64_t g0) {
          const int64_t h = (kvh - kv0) * group + g0;
          tile_accumulate<decltype(heads)::value, C, KV>(acc + h * C, scores + h * padded + t0, padded,
                                                         v_base + kvh * R, slot + t0, n, v_scale);
        });
      }
    }
  }

  void write(int64_t i, int64_t h, const vf* acc, float inv) const {
    scalar_t* dst = o_base + rows[i] * o_stride0 + h * o_stride1;
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < W; ++j) dst[c * W + j] = static_cast<scalar_t>(acc[c][j] * inv);
  }
};

// Fewer rows than threads (decode at batch 1): each row is cut by KV head and into
// position ranges of at least this many (flash-decoding's split-K), the parts run in
// parallel and are merged by their softmax maxima. With enough rows, one task per row.
constexpr int64_t kMinSplitPositions = 64;

template <typename scalar_t, typename KV, int D>
void attend_rows(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_table,
                 const int64_t* rows, const int64_t* reqs, const int64_t* ctx_lens,
                 int64_t num_rows, double scale, double k_scale, double v_scale) {
  using A = RowAttention<scalar_t, KV, D>;
  constexpr int C = A::C;
  A a;
  a.q_base = query.data_ptr<scalar_t>();
  a.o_base = out.data_ptr<scalar_t>();
  a.k_base = static_cast<const typename A::elem_t*>(key_cache.data_ptr());
  a.v_base = static_cast<const typename A::elem_t*>(value_cache.data_ptr());
  a.bt_base = block_table.data_ptr<int32_t>();
  a.rows = rows;
  a.reqs = reqs;
  a.ctx_lens = ctx_lens;
  a.num_heads = query.size(1);
  a.num_kv_heads = key_cache.size(2);
  a.group = a.num_heads / a.num_kv_heads;
  a.block_size = key_cache.size(1);
  a.block_shift = __builtin_ctzll(a.block_size);  // block sizes are powers of two
  a.tok_stride = a.num_kv_heads * A::R;           // between consecutive cache slots
  a.q_stride0 = query.stride(0);
  a.q_stride1 = query.stride(1);
  a.o_stride0 = out.stride(0);
  a.o_stride1 = out.stride(1);
  a.bt_stride = block_table.stride(0);
  a.scale = static_cast<float>(scale);
  a.k_scale = static_cast<float>(k_scale) * KV::kLayerFactor;  // x 2^k: exact
  a.v_scale = static_cast<float>(v_scale) * KV::kLayerFactor;

  const int64_t threads = at::get_num_threads();
  if (num_rows >= threads || threads == 1 || at::in_parallel_region()) {
    at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
      typename A::Scratch s;
      std::vector<vf> acc(a.num_heads * C);
      std::vector<float> m(a.num_heads), l(a.num_heads);
      for (int64_t i = begin; i < end; ++i) {
        a.part(i, 0, a.num_kv_heads, 0, ctx_lens[i], s, acc.data(), m.data(), l.data());
        for (int64_t h = 0; h < a.num_heads; ++h) a.write(i, h, acc.data() + h * C, 1.f / l[h]);
      }
    });
    return;
  }
  // Tasks (row, KV head, position range), the ranges of a (row, KV head) consecutive.
  struct Task {
    int64_t row, kvh, ta, tb;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first;  // first task of each (row, KV head), then the end
  const int64_t want = (2 * threads + num_rows * a.num_kv_heads - 1) / (num_rows * a.num_kv_heads);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t len = ctx_lens[i];
    const int64_t splits = std::max<int64_t>(1, std::min(want, len / kMinSplitPositions));
    const int64_t step = ((len + splits - 1) / splits + W - 1) / W * W;
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      first.push_back(static_cast<int64_t>(tasks.size()));
      for (int64_t ta = 0; ta < len; ta += step) tasks.push_back({i, kvh, ta, std::min(len, ta + step)});
    }
  }
  first.push_back(static_cast<int64_t>(tasks.size()));
  const int64_t g = a.group, n = static_cast<int64_t>(tasks.size());
  std::vector<vf> acc(n * g * C);
  std::vector<float> m(n * g), l(n * g);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    typename A::Scratch s;
    for (int64_t t = begin; t < end; ++t) {
      const Task& k = tasks[t];
      a.part(k.row, k.kvh, k.kvh + 1, k.ta, k.tb, s, acc.data() + t * g * C, m.data() + t * g, l.data() + t * g);
    }
  });
  // Merge the ranges: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max m_s.
  std::vector<vf> sum(C);
  for (size_t f = 0; f + 1 < first.size(); ++f) {
    const int64_t t0 = first[f], t1 = first[f + 1];
    const Task& k = tasks[t0];
    for (int64_t h = 0; h < g; ++h) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, m[t * g + h]);
      std::fill(sum.begin(), sum.end(), vf{});
      float den = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const float w = std::exp(m[t * g + h] - mx);
        den += w * l[t * g + h];
        for (int c = 0; c < C; ++c) sum[c] += w * acc[(t * g + h) * C + c];
      }
      a.write(k.row, k.kvh * g + h, sum.data(), 1.f / den);
    }
  }
}

// Calls fn(KV{}) with the cache format of ``cache`` (checked: the query's dtype, fp8 e4m3fn
// or e5m2, or int8 rows of head_dim + 4).
template <typename scalar_t, typename Fn>
void with_cache_format(at::ScalarType cache, Fn&& fn) {
  switch (cache) {
    case at::kFloat8_e4m3fn: return fn(Fp8E4M3KV{});
    case at::kFloat8_e5m2: return fn(Fp8E5M2KV{});
    case at::kChar: return fn(Int8KV{});
    default: return fn(PlainKV<scalar_t>{});
  }
}

void paged_attention_rows(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_table,
                          const at::Tensor& rows, const at::Tensor& reqs,
                          const at::Tensor& ctx_lens, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "bad KV cache shape");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && query.stride(2) == 1 && out.stride(2) == 1,
              "query/out must be [T, heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have the query's dtype");
  const at::ScalarType cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_dtype, "the K and V caches differ in dtype");
  const bool quantized =
      cache_dtype == at::kFloat8_e4m3fn || cache_dtype == at::kFloat8_e5m2 || cache_dtype == at::kChar;
  TORCH_CHECK(quantized || cache_dtype == query.scalar_type(),
              "the KV cache must have the query's dtype, or be fp8 (float8_e4m3fn, float8_e5m2) or int8; got ",
              cache_dtype, " for a ", query.scalar_type(), " query");
  TORCH_CHECK(!quantized || query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                  query.scalar_type() == at::kHalf,
              "a quantized KV cache takes fp32, bf16 or fp16 queries, got ", query.scalar_type());
  TORCH_CHECK(std::isfinite(k_scale) && std::isfinite(v_scale) && k_scale > 0 && v_scale > 0 && k_scale < 1e30 &&
                  v_scale < 1e30,
              "k_scale and v_scale must be positive and finite, got ", k_scale, " and ", v_scale);
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t bs = key_cache.size(1);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "block_size must be a power of two, got ", bs);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table: int32 rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && reqs.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong && rows.is_contiguous() && reqs.is_contiguous() &&
                  ctx_lens.is_contiguous(),
              "rows, reqs and ctx_lens must be contiguous int64");
  const int64_t n = rows.numel();
  TORCH_CHECK(reqs.numel() == n && ctx_lens.numel() == n, "rows, reqs and ctx_lens differ in length");
  const int64_t head_dim = query.size(2);
  const int64_t row_width = head_dim + (cache_dtype == at::kChar ? Int8KV::kScaleBytes : 0);
  TORCH_CHECK(key_cache.size(3) == row_width, "the cache's last dim must be ", row_width, " (head_dim ", head_dim,
              cache_dtype == at::kChar ? " + 4 scale bytes" : "", "), got ", key_cache.size(3));
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  // The index tensors hold one entry per row (a batch): checking them is cheap, and a bad
  // one would read or write outside the tensors.
  const int64_t max_ctx = block_table.size(1) * bs;
  const int64_t *rp = rows.data_ptr<int64_t>(), *qp = reqs.data_ptr<int64_t>(), *cp = ctx_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < query.size(0), "row ", rp[i], " out of range");
    TORCH_CHECK(qp[i] >= 0 && qp[i] < block_table.size(0), "request ", qp[i], " out of range");
    TORCH_CHECK(cp[i] >= 1 && cp[i] <= max_ctx, "context length ", cp[i], " not in [1, ", max_ctx, "]");
  }
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim ", head_dim, " is not supported (64 or 128)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_rows", [&] {
    with_cache_format<scalar_t>(cache_dtype, [&](auto format) {
      using KV = decltype(format);
      // no instances for double queries over a quantized cache (checked above)
      if constexpr (std::is_same_v<KV, PlainKV<scalar_t>> || !std::is_same_v<scalar_t, double>) {
        const int64_t *r = rows.data_ptr<int64_t>(), *q = reqs.data_ptr<int64_t>(), *c = ctx_lens.data_ptr<int64_t>();
        if (head_dim == 64)
          attend_rows<scalar_t, KV, 64>(out, query, key_cache, value_cache, block_table, r, q, c, n, scale, k_scale,
                                        v_scale);
        else
          attend_rows<scalar_t, KV, 128>(out, query, key_cache, value_cache, block_table, r, q, c, n, scale, k_scale,
                                         v_scale);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(actorserve_cpu, m) {
  m.def(
      "paged_attention_rows(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor rows, Tensor reqs, Tensor ctx_lens, float scale, float k_scale=1.0, "
      "float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) { m.impl("paged_attention_rows", &paged_attention_rows); }
