// The experts of a mixture-of-experts layer on CPUs (actorserve_kernels/moe.py states the math):
// out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].
// With expert parallelism an id of -1 marks a pair whose expert another rank holds
// (moe.fused_experts maps the global ids through the layer's expert_map): the pair is left
// out, so the result is this rank's share of the sum (zeros for a token with no local pair).
//
// The (token, j) pairs of local experts are grouped by expert with a counting sort (stable:
// each expert's pairs in increasing token order, as the reference gathers them), and each
// expert with tokens runs its two GEMMs over its tokens only:
// - an expert with 1-4 tokens (decode, and most experts of a small batch) streams its
//   weights once, as gemv.cpp's small_linear does (M = 1, 2 or 4 rows of x, zero-padded;
//   fp32 x, fp32 or bf16 weights, fp32 accumulation, the activation kept in fp32); the
//   row blocks of every such expert are one parallel_for, so two experts of a decode step
//   share the threads instead of running one after the other;
// - an expert with more tokens gathers them into a block and calls at::linear (oneDNN),
//   like the reference: for fp32 the same GEMM on the same rows, for bf16 the same bf16
//   GEMMs with their bf16 intermediates.
// Each local pair's result goes to its own fp32 row of a [local pairs, H] buffer (the row of
// its place in sorted order: an expert's rows are contiguous, remote pairs take none), and
// each token's rows are then summed in a fixed order (by expert id, as the reference's
// index_add_ over sorted experts adds them, ties in order of j) and rounded once to the
// hidden dtype: the result does not depend on thread scheduling.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kMaxStreamTokens = 4;  // experts with more tokens take at::linear

inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return static_cast<float>(v); }

// out[m * ldo + r0 + r] = sum_c x[m * k + c] * w[(r0 + r) * k + c] for m < M, r < rows
// (rows <= W / M), k a multiple of W: one contiguous chunk of the weight, M x W / M vector
// accumulators reduced by sum16 (lane m * R + r).
template <int M, typename wt>
inline void gemv_block(float* out, int64_t ldo, const float* x, const wt* w, int64_t r0, int rows, int64_t k) {
  constexpr int R = W / M;
  vf acc[W] = {};
  for (int64_t c = 0; c < k; c += W) {
    vf xv[M];
    for (int m = 0; m < M; ++m) std::memcpy(&xv[m], x + m * k + c, sizeof(vf));
    for (int r = 0; r < R; ++r) {
      if (r < rows) {
        const vf wv = load_vec(w + (r0 + r) * k + c);
        for (int m = 0; m < M; ++m) acc[m * R + r] += xv[m] * wv;
      }
    }
  }
  const vf sums = sum16(acc);
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < rows; ++r) out[m * ldo + r0 + r] = sums[m * R + r];
}

template <typename wt>
inline void gemv_block_m(int m, float* out, int64_t ldo, const float* x, const wt* w, int64_t r0, int rows,
                         int64_t k) {
  switch (m) {
    case 1: return gemv_block<1>(out, ldo, x, w, r0, rows, k);
    case 2: return gemv_block<2>(out, ldo, x, w, r0, rows, k);
    default: return gemv_block<4>(out, ldo, x, w, r0, rows, k);
  }
}

// o[i] = silu(g[i]) * u[i] for i < d (fp32 math, one rounding into o's type).
template <typename in_t, typename out_t>
inline void silu_mul_row(out_t* o, const in_t* g, const in_t* u, int64_t d) {
  int64_t i = 0;
  for (; i + W <= d; i += W) {
    const vf gv = load_vec(g + i), uv = load_vec(u + i);
    const vf r = gv / (1.f + exp_vec(-gv)) * uv;
    if constexpr (std::is_same_v<out_t, float>) {
      std::memcpy(o + i, &r, sizeof(r));
    } else {
      store_vec(o + i, r);
    }
  }
  for (; i < d; ++i) o[i] = static_cast<out_t>(f32(g[i]) / (1.f + std::exp(-f32(g[i]))) * f32(u[i]));
}

// One expert's share of the streaming path: its rows of the [pairs, ...] buffers.
struct Stream {
  int64_t expert;
  int64_t first;  // its first pair in sorted order
  int64_t n;      // its pairs (1..kMaxStreamTokens)
  int m;          // n rounded up to 1, 2 or 4 rows
  int64_t buf;    // its first row in the padded fp32 buffers
};

template <typename scalar_t>
void fused_moe_impl(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                    const float* weights, const int64_t* ids, int64_t k) {
  const int64_t tokens = hidden.size(0), h = hidden.size(1), experts = w13.size(0), inter = w2.size(2);
  const int64_t pairs = tokens * k;

  // Counting sort of the local pairs by expert (stable); slot[p]: pair p's place in sorted
  // order, -1 for a pair of another rank's expert (id -1).
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p)
    if (ids[p] >= 0) ++offsets[ids[p] + 1];
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t local_pairs = offsets[experts];
  std::vector<int64_t> sorted(local_pairs), slot(pairs, -1);
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t p = 0; p < pairs; ++p)
      if (ids[p] >= 0) {
        slot[p] = next[ids[p]];
        sorted[next[ids[p]]++] = p;
      }
  }

  // y[i] = expert ids[p]'s MLP of token p / k, fp32, for p = sorted[i].
  at::Tensor y = at::empty({local_pairs, h}, hidden.options().dtype(at::kFloat));
  float* y_base = y.data_ptr<float>();
  const scalar_t* x_base = hidden.data_ptr<scalar_t>();
  const scalar_t* w13_base = w13.data_ptr<scalar_t>();
  const scalar_t* w2_base = w2.data_ptr<scalar_t>();
  const bool stream_ok = h % W == 0 && inter % W == 0;

  std::vector<Stream> streams;
  int64_t stream_rows = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = offsets[e], n = offsets[e + 1] - first;
    if (n == 0) continue;
    if (stream_ok && n <= kMaxStreamTokens) {
      const int m = n == 1 ? 1 : n == 2 ? 2 : 4;
      streams.push_back({e, first, n, m, stream_rows});
      stream_rows += m;
      continue;
    }
    // Many tokens: gather, at::linear in the hidden dtype (the reference's GEMMs).
    at::Tensor rows = at::from_blob(sorted.data() + first, {n}, at::TensorOptions().dtype(at::kLong));
    at::Tensor x = hidden.index_select(0, rows.div(k, "floor"));
    at::Tensor gate_up = at::linear(x, w13[e]);
    at::Tensor act = at::empty({n, inter}, hidden.options());
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* a = act.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        silu_mul_row(a + i * inter, gu + i * 2 * inter, gu + i * 2 * inter + inter, inter);
    });
    at::Tensor y_e = y.narrow(0, first, n);  // the expert's rows: contiguous
    if constexpr (std::is_same_v<scalar_t, float>) {
      at::linear_out(y_e, act, w2[e]);
    } else {
      y_e.copy_(at::linear(act, w2[e]));
    }
  }

  if (!streams.empty()) {
    // Few tokens: the experts' rows in padded fp32 buffers, the weight streamed in blocks
    // of W / m rows; one parallel_for over every expert's blocks per GEMM.
    at::Tensor xs = at::zeros({stream_rows, h}, y.options());
    at::Tensor gu = at::empty({stream_rows, 2 * inter}, y.options());
    at::Tensor act = at::empty({stream_rows, inter}, y.options());
    at::Tensor ys = at::empty({stream_rows, h}, y.options());
    float *xs_p = xs.data_ptr<float>(), *gu_p = gu.data_ptr<float>(), *act_p = act.data_ptr<float>(),
          *ys_p = ys.data_ptr<float>();
    for (const Stream& s : streams)
      for (int64_t i = 0; i < s.n; ++i) {
        const scalar_t* src = x_base + (sorted[s.first + i] / k) * h;
        float* dst = xs_p + (s.buf + i) * h;
        for (int64_t c = 0; c < h; ++c) dst[c] = f32(src[c]);
      }
    // (stream, first row) of every block of W / m rows of an n_rows-row weight
    auto blocks_of = [&](int64_t n_rows) {
      std::vector<std::pair<int32_t, int64_t>> blocks;
      for (size_t i = 0; i < streams.size(); ++i) {
        const int64_t r = W / streams[i].m;
        for (int64_t r0 = 0; r0 < n_rows; r0 += r) blocks.emplace_back(static_cast<int32_t>(i), r0);
      }
      return blocks;
    };
    const auto up_blocks = blocks_of(2 * inter);
    at::parallel_for(0, static_cast<int64_t>(up_blocks.size()), 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const Stream& s = streams[up_blocks[b].first];
        const int64_t r0 = up_blocks[b].second;
        const int rows = static_cast<int>(std::min<int64_t>(W / s.m, 2 * inter - r0));
        gemv_block_m(s.m, gu_p + s.buf * 2 * inter, 2 * inter, xs_p + s.buf * h, w13_base + s.expert * 2 * inter * h,
                     r0, rows, h);
      }
    });
    for (int64_t r = 0; r < stream_rows; ++r)
      silu_mul_row(act_p + r * inter, gu_p + r * 2 * inter, gu_p + r * 2 * inter + inter, inter);
    const auto down_blocks = blocks_of(h);
    at::parallel_for(0, static_cast<int64_t>(down_blocks.size()), 16, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const Stream& s = streams[down_blocks[b].first];
        const int64_t r0 = down_blocks[b].second;
        const int rows = static_cast<int>(std::min<int64_t>(W / s.m, h - r0));
        gemv_block_m(s.m, ys_p + s.buf * h, h, act_p + s.buf * inter, w2_base + s.expert * h * inter, r0, rows,
                     inter);
      }
    });
    for (const Stream& s : streams)
      std::memcpy(y_base + s.first * h, ys_p + s.buf * h, s.n * h * sizeof(float));
  }

  // out[t] = sum of its local pairs' weighted rows, in order of expert id (then j), from 0
  // (zeros for a token whose experts are all remote).
  scalar_t* o_base = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    order.reserve(k);
    std::vector<float> acc(h);
    for (int64_t t = begin; t < end; ++t) {
      order.clear();
      for (int64_t j = 0; j < k; ++j)
        if (ids[t * k + j] >= 0) order.push_back(t * k + j);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p : order) {
        const float wt = weights[p];
        const float* yr = y_base + slot[p] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) acc[c] += yr[c] * wt;
      }
      scalar_t* o = o_base + t * h;
      int64_t c = 0;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        for (; c + W <= h; c += W) store_vec(o + c, load_vec(acc.data() + c));
      }
      for (; c < h; ++c) o[c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

// out [T, H] = the experts' weighted sum for hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]
// (fp32 or bf16, all one dtype), topk_weights [T, k] (any float dtype, read as fp32),
// topk_ids [T, k] (int32 or int64, each in [0, E), or -1: a pair of an expert this rank
// does not hold, left out).
void fused_moe(at::Tensor out, const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
               const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fused_moe takes fp32 or bf16, got ", dtype);
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype && out.scalar_type() == dtype,
              "fused_moe: hidden, w13, w2 and out must have one dtype");
  TORCH_CHECK(hidden.dim() == 2 && w13.dim() == 3 && w2.dim() == 3,
              "fused_moe: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t tokens = hidden.size(0), h = hidden.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == h && w2.size(0) == experts && w2.size(1) == h,
              "fused_moe: w13 must be [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe: topk_weights and topk_ids must be [T, k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt,
              "fused_moe: topk_ids must be int32 or int64");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == tokens && out.size(1) == h,
              "fused_moe: out must be [T, H] contiguous");
  if (tokens == 0) return;
  const int64_t k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id_p = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens * k; ++p)
    TORCH_CHECK(id_p[p] >= -1 && id_p[p] < experts, "fused_moe: expert id ", id_p[p], " out of [-1, ", experts, ")");
  const at::Tensor x = hidden.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
  with_dtype(dtype, [&](auto tag) {
    fused_moe_impl<decltype(tag)>(out, x, w13c, w2c, weights.data_ptr<float>(), id_p, k);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def("fused_moe(Tensor(a!) out, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }
