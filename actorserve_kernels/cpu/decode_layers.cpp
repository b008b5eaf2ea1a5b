// A decode step's decoder layers in one call: the model's per-layer ops (add + RMSNorm,
// quantized q/k/v projection, rotary, the K/V cache write, paged attention, o projection,
// add + RMSNorm, gate/up, SwiGLU, down), in the order and with the kernels the Python
// model uses, without returning to Python between them.
//
// At batch 1 a step is ~250 small ops; from Python each costs interpreter and dispatch
// time, and while Python runs the kernels' OpenMP workers go idle, so the next parallel
// region starts cold: together as much as the kernels' own time (bench/RESULTS.md, issue
// 15). Here the ops follow each other back to back. Each op is the same registered
// kernel the Python path calls (through the dispatcher: they live in other translation
// units), so results are identical to the unfused model's.
//
// Scope: every row a decode row (one new token per request), fp32 or bf16 CPU (a bf16 model's
// ops take bf16 and do their math in fp32, as the Python layers call them), one tensor-parallel
// rank, every linear quantized (``quant_linear``), no q/k norm; the Python model checks
// this and runs its own layers otherwise. The KV caches may be quantized
// (``--kv-cache-dtype``: fp8 e4m3fn / e5m2 with the layers' scales, or int8 rows): K and V
// are written quantized as ``kv_quant.quantize`` writes them, bit for bit (``write_kv_cache``,
// also an op of its own), and read by ``paged_attention_rows``.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "vec.h"

namespace {

// One (token, head) row of K or V as the cache stores it, kv_quant.quantize's arithmetic
// step for step in fp32 (so bit for bit): fp8: x / scale, clamped to the format's largest
// finite value (a NaN stays NaN), rounded to nearest even by c10's conversion, which torch's
// ``.to(float8)`` uses; int8: scale = max(absmax, 1e-12) / 127, round-half-even(x / scale)
// clamped to +-127 (a NaN, which torch converts to 0, to 0), then the scale's 4 bytes.
template <typename src_t, typename fp8_t>
inline void quantize_row_fp8(uint8_t* dst, const src_t* src, int64_t n, float scale) {
  const float limit = static_cast<float>(std::numeric_limits<fp8_t>::max());
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(src[j]) / scale;
    if (!std::isnan(v)) v = std::min(std::max(v, -limit), limit);
    dst[j] = fp8_t(v).x;
  }
}

template <typename src_t>
inline void quantize_row_int8(int8_t* dst, const src_t* src, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(static_cast<float>(src[j]));
    nan |= std::isnan(a);
    amax = std::max(amax, a);
  }
  // torch's amax of a row with a NaN is the default NaN (0x7fc00000), whatever the payload
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, 1e-12f) / 127.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float q = std::nearbyint(static_cast<float>(src[j]) / scale);  // round half to even
    dst[j] = std::isnan(q) ? 0 : static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
  }
  std::memcpy(dst + n, &scale, sizeof(scale));
}

// K and V of token t ([T, kv_heads, head_dim] at key/value, strides in elements, the last
// dimension contiguous) into cache slot slots[t] (skipped when negative: padding), quantized
// for a quantized cache. Slots are checked by the caller.
template <typename src_t>
void write_kv_rows(const src_t* key, const src_t* value, int64_t t_stride_k, int64_t h_stride_k,
                   int64_t t_stride_v, int64_t h_stride_v, at::Tensor& key_cache, at::Tensor& value_cache,
                   const int64_t* slots, int64_t tokens, int64_t heads, int64_t head_dim, float k_scale,
                   float v_scale) {
  const at::ScalarType dtype = key_cache.scalar_type();
  const int64_t row_bytes = key_cache.size(3) * key_cache.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = (slots[t] * heads + h) * row_bytes;
      const src_t* k = key + t * t_stride_k + h * h_stride_k;
      const src_t* v = value + t * t_stride_v + h * h_stride_v;
      switch (dtype) {
        case at::kFloat8_e4m3fn:
          quantize_row_fp8<src_t, c10::Float8_e4m3fn>(reinterpret_cast<uint8_t*>(kc + off), k, head_dim, k_scale);
          quantize_row_fp8<src_t, c10::Float8_e4m3fn>(reinterpret_cast<uint8_t*>(vc + off), v, head_dim, v_scale);
          break;
        case at::kFloat8_e5m2:
          quantize_row_fp8<src_t, c10::Float8_e5m2>(reinterpret_cast<uint8_t*>(kc + off), k, head_dim, k_scale);
          quantize_row_fp8<src_t, c10::Float8_e5m2>(reinterpret_cast<uint8_t*>(vc + off), v, head_dim, v_scale);
          break;
        case at::kChar:
          quantize_row_int8(reinterpret_cast<int8_t*>(kc + off), k, head_dim);
          quantize_row_int8(reinterpret_cast<int8_t*>(vc + off), v, head_dim);
          break;
        default:  // the source's dtype (checked)
          std::memcpy(kc + off, k, row_bytes);
          std::memcpy(vc + off, v, row_bytes);
      }
    }
  }
}

bool is_quantized(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar; }

// K and V caches for rows of head_dim values of dtype src: the model's dtype, fp8 of the
// same shape, or int8 rows of head_dim + 4 (the fp32 scale's bytes after the values).
void check_cache_pair(const at::Tensor& k, const at::Tensor& v, at::ScalarType src, int64_t heads, int64_t head_dim,
                      const char* who) {
  const at::ScalarType dtype = k.scalar_type();
  TORCH_CHECK(dtype == src || is_quantized(dtype), who, ": a cache must have the model's dtype (", src,
              "), or be float8_e4m3fn, float8_e5m2 or int8; got ", dtype);
  const int64_t width = head_dim + (dtype == at::kChar ? 4 : 0);
  TORCH_CHECK(v.scalar_type() == dtype && k.is_contiguous() && v.is_contiguous() && k.dim() == 4 &&
                  k.sizes() == v.sizes() && k.size(2) == heads && k.size(3) == width,
              who, ": K and V caches must be contiguous ", dtype, " [blocks, block_size, ", heads, ", ", width,
              "], got ", k.sizes(), " and ", v.sizes());
}

void check_scale(double s, const char* what) {
  TORCH_CHECK(std::isfinite(s) && s > 0 && s < 1e30, what, " must be positive and finite, got ", s);
}

// The op: key/value [T, kv_heads, head_dim] (last dim contiguous) into their slots
// (int64, negative: skipped), as kv_quant.write (for a plain cache: index_copy_) does.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slots, double k_scale, double v_scale) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv_cache: key and value must be [T, kv_heads, head_dim] with a contiguous last dimension");
  const at::ScalarType src = key.scalar_type();
  TORCH_CHECK(value.scalar_type() == src && (src == at::kFloat || src == at::kBFloat16 || src == at::kHalf),
              "write_kv_cache: key and value must be fp32, bf16 or fp16 alike");
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  check_cache_pair(key_cache, value_cache, src, heads, head_dim, "write_kv_cache");
  check_scale(k_scale, "k_scale");
  check_scale(v_scale, "v_scale");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.numel() == tokens,
              "write_kv_cache: slots must be contiguous int64, one per token");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " not below ", num_slots);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, src, "write_kv_cache", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      write_kv_rows(key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), key.stride(0), key.stride(1),
                    value.stride(0), value.stride(1), key_cache, value_cache, slot, tokens, heads, head_dim,
                    static_cast<float>(k_scale), static_cast<float>(v_scale));
  });
}

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const at::Tensor&, const c10::optional<at::Tensor>&,
                                const at::Tensor&, double)>
      add_rms_norm = find_op<void(at::Tensor, at::Tensor, const at::Tensor&, const c10::optional<at::Tensor>&,
                                  const at::Tensor&, double)>("actorserve_cpu::add_rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t)> quant_linear =
      find_op<void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>("actorserve_cpu::quant_linear");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&)> rotary =
      find_op<void(at::Tensor, const at::Tensor&, const at::Tensor&)>("actorserve_cpu::rotary_embedding");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&)> silu_and_mul =
      find_op<void(at::Tensor, const at::Tensor&)>("actorserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                double, double)>
      attention = find_op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, double)>(
          "actorserve_cpu::paged_attention_rows");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

constexpr int64_t kPerLayer = 7;  // norm1, qkv, qkv bias (empty: none), o, norm2, gate_up, down

// weights: kPerLayer tensors per layer (packed as ``quant_pack`` left them); types: the
// ggml type of qkv, o, gate_up, down per layer; dims: their output sizes (same for every
// layer). hidden [T, H] is the embedding output; returns (hidden, residual) after the last
// layer, as the Python layers return them (the final norm is the caller's). The caches may
// be quantized (see above); k_scales / v_scales: each layer's fp8 K and V scales, required
// for fp8 caches (none: every layer's is 1.0), ignored for the others.
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& hidden_in, at::TensorList weights,
                                                 at::IntArrayRef types, at::IntArrayRef dims,
                                                 at::TensorList k_caches, at::TensorList v_caches,
                                                 const at::Tensor& block_table, const at::Tensor& slots,
                                                 const at::Tensor& ctx_lens, const at::Tensor& cos,
                                                 const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                                                 double eps, double scale, at::ArrayRef<double> k_scales,
                                                 at::ArrayRef<double> v_scales) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && static_cast<int64_t>(types.size()) == layers * 4 &&
                  dims.size() == 4 && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: ", kPerLayer, " weights and 4 types per layer, 4 dims");
  const at::ScalarType dtype = hidden_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && hidden_in.dim() == 2 && hidden_in.is_contiguous(),
              "decode_layers: contiguous fp32 or bf16 hidden [T, H]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  const Ops& op = ops();
  const int64_t tokens = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t qkv_n = dims[0], gate_up_n = dims[2];
  const int64_t head_dim = qkv_n / (num_heads + 2 * num_kv_heads);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv_n == q_size + 2 * kv_size && dims[1] == hidden_size && dims[3] == hidden_size, "decode_layers: dims");
  TORCH_CHECK(slots.numel() == tokens && ctx_lens.numel() == tokens, "decode_layers: one slot and length per row");
  bool fp8 = false;
  for (int64_t l = 0; l < layers; ++l) {
    check_cache_pair(k_caches[l], v_caches[l], dtype, num_kv_heads, head_dim, "decode_layers");
    TORCH_CHECK(k_caches[l].size(0) == k_caches[0].size(0) && k_caches[l].size(1) == k_caches[0].size(1),
                "decode_layers: every layer's cache must have the same blocks");
    fp8 |= k_caches[l].scalar_type() == at::kFloat8_e4m3fn || k_caches[l].scalar_type() == at::kFloat8_e5m2;
  }
  TORCH_CHECK(k_scales.size() == v_scales.size() &&
                  (k_scales.empty() || static_cast<int64_t>(k_scales.size()) == layers),
              "decode_layers: k_scales and v_scales: one per layer, or none");
  TORCH_CHECK(!fp8 || !k_scales.empty(), "decode_layers: fp8 KV caches need k_scales and v_scales (one per layer)");
  for (size_t l = 0; l < k_scales.size(); ++l) {
    check_scale(k_scales[l], "decode_layers: k_scales");
    check_scale(v_scales[l], "decode_layers: v_scales");
  }
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "decode_layers: slot ", slot[t], " not in [0, ", num_slots,
                ") (padding rows are not supported)");

  const auto opts = hidden_in.options();
  at::Tensor normed = at::empty({tokens, hidden_size}, opts), qkv = at::empty({tokens, qkv_n}, opts);
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, opts), proj = at::empty({tokens, hidden_size}, opts);
  at::Tensor gate_up = at::empty({tokens, gate_up_n}, opts), act = at::empty({tokens, gate_up_n / 2}, opts);
  at::Tensor hidden = at::empty({tokens, hidden_size}, opts);
  at::Tensor residual[2] = {at::empty({tokens, hidden_size}, opts), at::empty({tokens, hidden_size}, opts)};
  const at::Tensor rows = at::arange(tokens, slots.options());  // row i is request i's token
  const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  const at::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const void* qkv_data = qkv.data_ptr();
  const at::Tensor empty_sum = at::empty({0, hidden_size}, opts);

  at::Tensor x = hidden_in;
  int cur = 0;  // residual[cur] holds the running residual
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    const int64_t* ty = types.data() + l * 4;
    if (l == 0) {
      op.add_rms_norm.call(normed, empty_sum, x, c10::nullopt, w[0], eps);
      residual[cur].copy_(x);
    } else {
      op.add_rms_norm.call(normed, residual[1 - cur], x, residual[cur], w[0], eps);
      cur = 1 - cur;
    }
    op.quant_linear.call(qkv, normed, w[1], ty[0], qkv_n);
    if (w[2].numel()) qkv.add_(w[2]);
    op.rotary.call(qk, cos, sin);
    // K and V of each token into its cache slot, as reshape_and_cache (kv_quant.write for a
    // quantized cache) does.
    const double k_scale = k_scales.empty() ? 1.0 : k_scales[l], v_scale = v_scales.empty() ? 1.0 : v_scales[l];
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    with_dtype(dtype, [&](auto zero) {
      using src_t = decltype(zero);
      const src_t* k = static_cast<const src_t*>(qkv_data) + q_size;
      write_kv_rows(k, k + kv_size, qkv_n, head_dim, qkv_n, head_dim, kc, vc, slot, tokens, num_kv_heads, head_dim,
                    static_cast<float>(k_scale), static_cast<float>(v_scale));
    });
    op.attention.call(attn, query, kc, vc, block_table, rows, rows, ctx_lens, scale, k_scale, v_scale);
    op.quant_linear.call(proj, attn.view({tokens, q_size}), w[3], ty[1], hidden_size);
    op.add_rms_norm.call(normed, residual[1 - cur], proj, residual[cur], w[4], eps);
    cur = 1 - cur;
    op.quant_linear.call(gate_up, normed, w[5], ty[2], gate_up_n);
    op.silu_and_mul.call(act, gate_up);
    op.quant_linear.call(hidden, act, w[6], ty[3], hidden_size);
    x = hidden;
  }
  return {hidden, residual[cur]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, int[] types, int[] dims, Tensor[] k_caches, "
      "Tensor[] v_caches, Tensor block_table, Tensor slots, Tensor ctx_lens, Tensor cos, Tensor sin, "
      "int num_heads, int num_kv_heads, float eps, float scale, float[] k_scales=[], float[] v_scales=[]) -> "
      "(Tensor, Tensor)");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, "
      "float k_scale=1.0, float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("write_kv_cache", &write_kv_cache);
}
