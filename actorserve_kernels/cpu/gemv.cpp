// Linear layers for a handful of tokens (decode at batch 1-4) on CPUs: y = x W^T.
//
// With one to four rows of x, a linear layer is a stream over its weight: every weight
// byte is read once and used for M multiply-adds, so the time is the weight's size over
// memory bandwidth. This kernel reads W [N, K] as it lies in memory, 16 / M consecutive
// rows at a time (one contiguous chunk), keeping M x (16 / M) vector accumulators in
// registers and reducing them with one shuffle tree (sum16), so it streams at close to
// the machine's read bandwidth (~30 GB/s on the 2-core dev VM, where oneDNN's GEMM
// reached ~22 GB/s at one token). From 4 rows on, x is reloaded once per weight vector
// and oneDNN is as fast or faster: the model uses this op for 1 and 2 rows only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "vec.h"

namespace {

template <int M>
void gemv_rows(float* out, const float* x, const float* w, int64_t n, int64_t k) {
  constexpr int R = W / M;  // weight rows per block
  const int64_t num_blocks = (n + R - 1) / R;
  at::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * R;
      const int rows = static_cast<int>(std::min<int64_t>(R, n - r0));
      vf acc[W] = {};
      for (int64_t c = 0; c < k; c += W) {
        vf xv[M];
        for (int m = 0; m < M; ++m) std::memcpy(&xv[m], x + m * k + c, sizeof(vf));
        for (int r = 0; r < R; ++r) {
          if (r < rows) {
            vf wv;
            std::memcpy(&wv, w + (r0 + r) * k + c, sizeof(vf));
            for (int m = 0; m < M; ++m) acc[m * R + r] += xv[m] * wv;
          }
        }
      }
      // lane m * R + r of sums = out[m][r0 + r]
      vf sums = sum16(acc);
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) out[m * n + r0 + r] = sums[m * R + r];
    }
  });
}

void small_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "small_linear is fp32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && out.size(0) == m && out.size(1) == n, "shape mismatch");
  TORCH_CHECK(k % W == 0, "K must be a multiple of ", W);
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  switch (m) {
    case 1: return gemv_rows<1>(o, xp, wp, n, k);
    case 2: return gemv_rows<2>(o, xp, wp, n, k);
    case 4: return gemv_rows<4>(o, xp, wp, n, k);
    default: TORCH_CHECK(false, "small_linear takes 1, 2 or 4 rows, got ", m);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) { m.def("small_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()"); }

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) { m.impl("small_linear", &small_linear); }
