// The small per-layer ops of a decoder (RMSNorm with its residual add, SwiGLU, rotary) fused
// into one pass each, for fp32 (or bf16) on CPUs. At decode a layer's activations are a few KB,
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

// The model's activations: fp32, or bf16 for a --dtype bfloat16 model (math in fp32, each
// result rounded once).
void check_rows(const at::Tensor& t, int64_t tokens, int64_t hidden, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == tokens && t.size(1) == hidden && t.stride(1) == 1, name,
              " must be [", tokens, ", ", hidden, "] with a contiguous last dimension");
}

void check_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, " takes fp32 or bf16, got ",
              t.scalar_type());
}

inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return static_cast<float>(v); }

// out = rms_norm(x + residual) * weight, sum_out = x + residual; without a residual,
// out = rms_norm(x) * weight and sum_out is not touched.
void add_rms_norm(at::Tensor out, at::Tensor sum_out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps) {
  const int64_t tokens = x.size(0), hidden = weight.numel();
  check_dtype(x, "add_rms_norm");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && weight.is_contiguous(), "weight must be contiguous ", dtype);
  check_rows(x, tokens, hidden, dtype, "x");
  check_rows(out, tokens, hidden, dtype, "out");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_rows(*residual, tokens, hidden, dtype, "residual");
    check_rows(sum_out, tokens, hidden, dtype, "sum_out");
  }
  const int64_t xs0 = x.stride(0), os0 = out.stride(0);
  const int64_t rs0 = has_res ? residual->stride(0) : 0, ss0 = has_res ? sum_out.stride(0) : 0;
  const float feps = static_cast<float>(eps);
  with_dtype(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    // Pointers and strides are read once, outside the threads.
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const scalar_t* x_base = x.data_ptr<scalar_t>();
    scalar_t* o_base = out.data_ptr<scalar_t>();
    const scalar_t* r_base = has_res ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* s_base = has_res ? sum_out.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* xs = x_base + t * xs0;
        scalar_t* o = o_base + t * os0;
        const scalar_t* src = xs;
        if (has_res) {
          const scalar_t* r = r_base + t * rs0;
          scalar_t* s = s_base + t * ss0;
          int64_t i = 0;
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            for (; i + W <= hidden; i += W) store_vec(s + i, load_vec(xs + i) + load_vec(r + i));
          }
#pragma omp simd
          for (int64_t j = i; j < hidden; ++j) s[j] = static_cast<scalar_t>(f32(xs[j]) + f32(r[j]));
          src = s;
        }
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (hidden % W == 0) {  // GCC does not vectorise c10's conversions: by hand
            vf acc = vf{};
            for (int64_t i = 0; i < hidden; i += W) {
              const vf v = load_vec(src + i);
              acc += v * v;
            }
            float sq = 0.f;
            for (int j = 0; j < W; ++j) sq += acc[j];
            const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + feps);
            for (int64_t i = 0; i < hidden; i += W) store_vec(o + i, load_vec(w + i) * (load_vec(src + i) * inv));
            continue;
          }
        }
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < hidden; ++i) sq += f32(src[i]) * f32(src[i]);
        const float inv = 1.f / std::sqrt(sq / static_cast<float>(hidden) + feps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<scalar_t>(f32(w[i]) * (f32(src[i]) * inv));
      }
    });
  });
}

// out = silu(gate) * up for gate_up = [gate | up] along the last dimension.
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  const int64_t tokens = gate_up.size(0), d = gate_up.size(1) / 2;
  check_dtype(gate_up, "silu_and_mul");
  check_rows(gate_up, tokens, 2 * d, gate_up.scalar_type(), "gate_up");
  check_rows(out, tokens, d, gate_up.scalar_type(), "out");
  const int64_t is0 = gate_up.stride(0), os0 = out.stride(0);
  with_dtype(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in_base = gate_up.data_ptr<scalar_t>();
    scalar_t* o_base = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = in_base + t * is0;
        const scalar_t* u = g + d;
        scalar_t* o = o_base + t * os0;
        int64_t i = 0;
        for (; i + W <= d; i += W) {
          const vf gv = load_vec(g + i), uv = load_vec(u + i);
          store_vec(o + i, gv / (1.f + exp_vec(-gv)) * uv);
        }
        for (; i < d; ++i) o[i] = static_cast<scalar_t>(f32(g[i]) / (1.f + std::exp(-f32(g[i]))) * f32(u[i]));
      }
    });
  });
}

// Neox-style rotary embedding in place: for each token t and head h of x [T, H, D]
// (a strided view, e.g. the q and k heads of a fused qkv tensor),
// x = x * cos[t] + cat(x2, x1) * sin[t], with cos = (cos | cos) and sin = (-sin | sin)
// rows of the model's table, [T, 1, D] views (in x's dtype).
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  check_dtype(x, "rotary_embedding");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos and sin in x's dtype");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && d % (2 * W) == 0, "x must be [T, heads, D] with D a multiple of ",
              2 * W, " and a contiguous last dimension");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(2) == d && t->stride(2) == 1,
                "cos/sin must be [T, 1, D] with a contiguous last dimension");
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  with_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* x_base = x.data_ptr<scalar_t>();
    const scalar_t *c_base = cos.data_ptr<scalar_t>(), *s_base = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t *c = c_base + t * cs0, *s = s_base + t * ss0;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = x_base + t * xs0 + h * xs1;
          for (int64_t i = 0; i < half; i += W) {
            const vf x1 = load_vec(v + i), x2 = load_vec(v + half + i);
            store_vec(v + i, x1 * load_vec(c + i) + x2 * load_vec(s + i));
            store_vec(v + half + i, x2 * load_vec(c + half + i) + x1 * load_vec(s + half + i));
          }
        }
      }
    });
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
