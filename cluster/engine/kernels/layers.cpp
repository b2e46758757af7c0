// A step's decoder layers in one call: the packed decoder's layer loop
// (cluster/engine/model.py, DecoderModel._layers) for a step whose every sequence is
// attended by the batched kernel and whose linears run blocked, op for op the same calls
// in the same order: the same kernels (blocked_linear.cpp, decode_attention.cpp, built
// into this module) and ATen's own silu, mul and add, so the same bits. From Python that
// loop is about 330 calls a step for a 30-layer model, each taking the GIL and
// dispatching: about a tenth of a decode step of 8 or 16 sequences alone (AMD EPYC, 2
// cores), and in a replica the event loop's thread wants the GIL meanwhile. Here the
// whole loop runs with the GIL released.
#define PREFIX_CACHE_NO_BINDINGS
#include "blocked_linear.cpp"
#include "decode_attention.cpp"
#undef PREFIX_CACHE_NO_BINDINGS

namespace {

// linear_layouts.linear(x, W, bias, BLOCKED, panels, residual), step for step.
torch::Tensor blocked(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, int64_t parts, int64_t kc,
                      const torch::Tensor* bias, const torch::Tensor* residual) {
  if (bias == nullptr && residual != nullptr) return blocked_linear(x, panels, n, parts, kc, *residual);
  torch::Tensor out = blocked_linear(x, panels, n, parts, kc, c10::nullopt);
  if (bias != nullptr) out.add_(*bias);
  return residual == nullptr ? out : *residual + out;
}

const torch::Tensor* at_or_null(const std::vector<torch::Tensor>& list, size_t i) {
  return list.empty() ? nullptr : &list[i];
}

}  // namespace

// hidden [N, hidden] (the step's embedded tokens), cos and sin [N, 1, head_dim]; per layer
// (lists of one entry a layer; an optional kind's list empty when the model has none):
// the norms' weights, the linears' panels (linear_layouts.Panels: n outputs each, summed
// in the group's (parts, kc) order) and biases, q/k norm; then paged_attention's
// arguments: the pool and the step's slot tables (checked and turned into offsets once for
// all layers). Returns the hidden state after the last layer.
torch::Tensor decoder_layers_paged(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const std::vector<torch::Tensor>& attn_norm, const std::vector<torch::Tensor>& qkv,
                                   const std::vector<torch::Tensor>& qkv_bias,
                                   const std::vector<torch::Tensor>& qk_norm, const std::vector<torch::Tensor>& o,
                                   const std::vector<torch::Tensor>& o_bias,
                                   const std::vector<torch::Tensor>& mlp_norm,
                                   const std::vector<torch::Tensor>& gate_up,
                                   const std::vector<torch::Tensor>& gate_up_bias,
                                   const std::vector<torch::Tensor>& down,
                                   const std::vector<torch::Tensor>& down_bias, const std::vector<int64_t>& outputs,
                                   int64_t parts, int64_t kc, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                   double eps, double scale, const torch::Tensor& pool, const torch::Tensor& slots,
                                   std::vector<int64_t> starts, std::vector<int64_t> positions,
                                   std::vector<int64_t> counts) {
  const size_t layers = attn_norm.size();
  TORCH_CHECK(qkv.size() == layers && o.size() == layers && mlp_norm.size() == layers &&
              gate_up.size() == layers && down.size() == layers, "decoder_layers: one entry a layer");
  for (const auto* list : {&qkv_bias, &qk_norm, &o_bias, &gate_up_bias, &down_bias})
    TORCH_CHECK(list->empty() || list->size() == layers, "decoder_layers: an optional list is empty or one a layer");
  TORCH_CHECK(outputs.size() == 4, "decoder_layers: outputs of qkv, o, gate_up, down");
  const SlotTable table = slot_table(pool, slots, std::move(starts), std::move(positions), std::move(counts));
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  for (size_t l = 0; l < layers; ++l) {
    const torch::Tensor attn_in = rms_norm(hidden, attn_norm[l], eps);
    const torch::Tensor fused = blocked(attn_in, qkv[l], outputs[0], parts, kc, at_or_null(qkv_bias, l), nullptr);
    torch::Tensor qk = fused.narrow(1, 0, q_width + kv_width).view({-1, heads + kv_heads, head_dim});
    if (!qk_norm.empty()) qk = rms_norm(qk, qk_norm[l], eps);
    qk = rope(qk, cos, sin);
    const torch::Tensor q = qk.narrow(1, 0, heads), k = qk.narrow(1, heads, kv_heads);
    const torch::Tensor v = fused.narrow(1, q_width + kv_width, kv_width).view({-1, kv_heads, head_dim});
    const torch::Tensor attn_out = attend_slots(q, k, v, table, static_cast<int64_t>(l), scale);
    hidden = blocked(attn_out.view({-1, q_width}), o[l], outputs[1], parts, kc, at_or_null(o_bias, l), &hidden);
    const torch::Tensor mlp_in = rms_norm(hidden, mlp_norm[l], eps);
    const std::vector<torch::Tensor> gate_and_up =
        blocked(mlp_in, gate_up[l], outputs[2], parts, kc, at_or_null(gate_up_bias, l), nullptr).chunk(2, -1);
    const torch::Tensor act = at::silu(gate_and_up[0]) * gate_and_up[1];
    hidden = blocked(act, down[l], outputs[3], parts, kc, at_or_null(down_bias, l), &hidden);
  }
  return hidden;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers_paged", &decoder_layers_paged,
        "a step's decoder layers on the compiled kernels, attention over a slotted KV pool (float32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
