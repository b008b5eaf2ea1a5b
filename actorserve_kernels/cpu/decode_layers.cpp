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
// this and runs its own layers otherwise.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>

namespace {

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
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      attention = find_op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
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
// layer, as the Python layers return them (the final norm is the caller's).
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& hidden_in, at::TensorList weights,
                                                 at::IntArrayRef types, at::IntArrayRef dims,
                                                 at::TensorList k_caches, at::TensorList v_caches,
                                                 const at::Tensor& block_table, const at::Tensor& slots,
                                                 const at::Tensor& ctx_lens, const at::Tensor& cos,
                                                 const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                                                 double eps, double scale) {
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
  for (int64_t l = 0; l < layers; ++l) {
    for (const at::Tensor& c : {k_caches[l], v_caches[l]})
      TORCH_CHECK(c.scalar_type() == dtype && c.is_contiguous() && c.dim() == 4 && c.size(2) * c.size(3) == kv_size &&
                      c.sizes() == k_caches[0].sizes(),
                  "decode_layers: every cache must be contiguous ", dtype, " [blocks, block_size, ", num_kv_heads,
                  ", ", head_dim, "], got ", c.sizes());
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
  const char* qkv_data = static_cast<const char*>(qkv.data_ptr());
  const int64_t elem = qkv.element_size();
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
    // K and V of each token into its cache slot, as reshape_and_cache does.
    char* kc = static_cast<char*>(k_caches[l].data_ptr());
    char* vc = static_cast<char*>(v_caches[l].data_ptr());
    for (int64_t t = 0; t < tokens; ++t) {
      const char* src = qkv_data + (t * qkv_n + q_size) * elem;
      std::memcpy(kc + slot[t] * kv_size * elem, src, kv_size * elem);
      std::memcpy(vc + slot[t] * kv_size * elem, src + kv_size * elem, kv_size * elem);
    }
    op.attention.call(attn, query, k_caches[l], v_caches[l], block_table, rows, rows, ctx_lens, scale);
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
      "int num_heads, int num_kv_heads, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(actorserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
