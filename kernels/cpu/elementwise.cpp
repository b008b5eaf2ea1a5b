// The small per-layer ops of a decoder (RMSNorm with its residual add, SwiGLU) fused
// into one pass each, for fp32 on CPUs. At decode a layer's activations are a few KB,
// so each torch op costs its dispatch (5-20 us) rather than its arithmetic; torch's
// rms_norm alone is ~7 ops. One loop per token, vectorised by the compiler; tokens
// are split across threads only when there are enough of them to pay for it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "vec.h"

namespace {

constexpr int64_t kGrain = 16;  // tokens per task: below this, one thread does it all

void check_rows(const at::Tensor& t, int64_t hidden, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be fp32");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == hidden && t.stride(1) == 1, name, " must be [T, ", hidden,
              "] with a contiguous last dimension");
}

// out = rms_norm(x + residual) * weight, sum_out = x + residual (residual may be undefined).
void add_rms_norm(at::Tensor out, at::Tensor sum_out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps) {
  const int64_t tokens = x.size(0), hidden = weight.numel();
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  check_rows(x, hidden, "x");
  check_rows(out, hidden, "out");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_rows(*residual, hidden, "residual");
    check_rows(sum_out, hidden, "sum_out");
  }
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xs = x.data_ptr<float>() + t * x.stride(0);
      float* o = out.data_ptr<float>() + t * out.stride(0);
      const float* src = xs;
      if (has_res) {
        const float* r = residual->data_ptr<float>() + t * residual->stride(0);
        float* s = sum_out.data_ptr<float>() + t * sum_out.stride(0);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) s[i] = xs[i] + r[i];
        src = s;
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += src[i] * src[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + feps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (src[i] * inv);
    }
  });
}

// out = silu(gate) * up for gate_up = [gate | up] along the last dimension.
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  const int64_t tokens = gate_up.size(0), d = gate_up.size(1) / 2;
  check_rows(gate_up, 2 * d, "gate_up");
  check_rows(out, d, "out");
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
      const float* u = g + d;
      float* o = out.data_ptr<float>() + t * out.stride(0);
      int64_t i = 0;
      for (; i + W <= d; i += W) {
        const vf gv = load_vec(g + i), uv = load_vec(u + i);
        const vf ov = gv / (1.f + exp_vec(-gv)) * uv;
        std::memcpy(o + i, &ov, sizeof(ov));
      }
      for (; i < d; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum_out, Tensor x, Tensor? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
