// The small per-layer ops of a decoder (RMSNorm with its residual add, SwiGLU, rotary) fused
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

void check_rows(const at::Tensor& t, int64_t tokens, int64_t hidden, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be fp32");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == tokens && t.size(1) == hidden && t.stride(1) == 1, name,
              " must be [", tokens, ", ", hidden, "] with a contiguous last dimension");
}

// out = rms_norm(x + residual) * weight, sum_out = x + residual; without a residual,
// out = rms_norm(x) * weight and sum_out is not touched.
void add_rms_norm(at::Tensor out, at::Tensor sum_out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps) {
  const int64_t tokens = x.size(0), hidden = weight.numel();
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be contiguous fp32");
  check_rows(x, tokens, hidden, "x");
  check_rows(out, tokens, hidden, "out");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_rows(*residual, tokens, hidden, "residual");
    check_rows(sum_out, tokens, hidden, "sum_out");
  }
  // Pointers and strides are read once, outside the threads.
  const float* w = weight.data_ptr<float>();
  const float* x_base = x.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float* r_base = has_res ? residual->data_ptr<float>() : nullptr;
  float* s_base = has_res ? sum_out.data_ptr<float>() : nullptr;
  const int64_t xs0 = x.stride(0), os0 = out.stride(0);
  const int64_t rs0 = has_res ? residual->stride(0) : 0, ss0 = has_res ? sum_out.stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xs = x_base + t * xs0;
      float* o = o_base + t * os0;
      const float* src = xs;
      if (has_res) {
        const float* r = r_base + t * rs0;
        float* s = s_base + t * ss0;
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
  check_rows(gate_up, tokens, 2 * d, "gate_up");
  check_rows(out, tokens, d, "out");
  const float* in_base = gate_up.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const int64_t is0 = gate_up.stride(0), os0 = out.stride(0);
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = in_base + t * is0;
      const float* u = g + d;
      float* o = o_base + t * os0;
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

// Neox-style rotary embedding in place: for each token t and head h of x [T, H, D]
// (a strided view, e.g. the q and k heads of a fused qkv tensor),
// x = x * cos[t] + cat(x2, x1) * sin[t], with cos = (cos | cos) and sin = (-sin | sin)
// rows of the model's table, [T, 1, D] views.
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_embedding is fp32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && d % (2 * W) == 0, "x must be [T, heads, D] with D a multiple of ",
              2 * W, " and a contiguous last dimension");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(2) == d && t->stride(2) == 1,
                "cos/sin must be [T, 1, D] with a contiguous last dimension");
  float* x_base = x.data_ptr<float>();
  const float *c_base = cos.data_ptr<float>(), *s_base = sin.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = c_base + t * cs0, *s = s_base + t * ss0;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x_base + t * xs0 + h * xs1;
        for (int64_t i = 0; i < half; i += W) {
          const vf x1 = load_vec(v + i), x2 = load_vec(v + half + i);
          const vf r1 = x1 * load_vec(c + i) + x2 * load_vec(s + i);
          const vf r2 = x2 * load_vec(c + half + i) + x1 * load_vec(s + half + i);
          std::memcpy(v + i, &r1, sizeof(r1));
          std::memcpy(v + half + i, &r2, sizeof(r2));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) sum_out, Tensor x, Tensor? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
