// Decode attention for a batch of sequences, each in a KV buffer of its own, in place.
//
// One call per layer for every sequence of a step that decodes one token:
// the token's K and V are written into its sequence's head-major buffer
// [layers, 2, kv_heads, capacity, head_dim] at its position, then each query
// head attends over that buffer's first position + 1 keys (its KV head's
// keys are contiguous rows: read once for the whole group of query heads).
// Work is split over (sequence, kv head) on ATen's thread pool. Float32 only;
// dot products and the softmax in float32, as the reference matmul path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Each row: softmax in place (max subtracted, libm's exp, one division).
void softmax_rows(float* scores, int64_t rows, int64_t length) {
  for (int64_t g = 0; g < rows; ++g) {
    float* row = scores + g * length;
    float top = row[0];
    for (int64_t s = 1; s < length; ++s) top = row[s] > top ? row[s] : top;
    float sum = 0.f;
    for (int64_t s = 0; s < length; ++s) {
      row[s] = std::exp(row[s] - top);
      sum += row[s];
    }
    const float inv = 1.f / sum;
    for (int64_t s = 0; s < length; ++s) row[s] *= inv;
  }
}

void attend_generic(const float* q, const float* keys, const float* values, float* out, int64_t group,
                    int64_t head_dim, int64_t length, float scale, float* scores) {
  // scores[g * length + s] = q_g . k_s * scale
  for (int64_t s = 0; s < length; ++s) {
    const float* k = keys + s * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < head_dim; ++d) acc += qg[d] * k[d];
      scores[g * length + s] = acc * scale;
    }
  }
  softmax_rows(scores, group, length);
  for (int64_t g = 0; g < group; ++g) {
    const float* row = scores + g * length;
    float* o = out + g * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
    for (int64_t s = 0; s < length; ++s) {
      const float p = row[s];
      const float* v = values + s * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * v[d];
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// head_dim == 64: each row of keys and values is eight 8-float vectors.
__attribute__((target("avx2,fma")))
void attend_avx2_64(const float* q, const float* keys, const float* values, float* out, int64_t group,
                    int64_t length, float scale, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * 64;
    __m256 qv[8];
    for (int j = 0; j < 8; ++j) qv[j] = _mm256_loadu_ps(qg + 8 * j);
    float* row = scores + g * length;
    int64_t s = 0;
    for (; s + 4 <= length; s += 4) {   // four keys at a time: four independent accumulations
      const float* k0 = keys + s * 64;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) {
        a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 8 * j), a0);
        a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 64 + 8 * j), a1);
        a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 128 + 8 * j), a2);
        a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 192 + 8 * j), a3);
      }
      row[s] = hsum(a0) * scale;
      row[s + 1] = hsum(a1) * scale;
      row[s + 2] = hsum(a2) * scale;
      row[s + 3] = hsum(a3) * scale;
    }
    for (; s < length; ++s) {
      const float* k = keys + s * 64;
      __m256 a = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a);
      row[s] = hsum(a) * scale;
    }
  }
  softmax_rows(scores, group, length);
  for (int64_t g = 0; g < group; ++g) {
    const float* row = scores + g * length;
    __m256 o[8];
    for (int j = 0; j < 8; ++j) o[j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < length; ++s) {
      const __m256 p = _mm256_set1_ps(row[s]);
      const float* v = values + s * 64;
      for (int j = 0; j < 8; ++j) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), o[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + g * 64 + 8 * j, o[j]);
  }
}
#endif

void attend_one(const float* q, const float* keys, const float* values, float* out, int64_t group,
                int64_t head_dim, int64_t length, float scale, float* scores) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && head_dim == 64) {
    attend_avx2_64(q, keys, values, out, group, length, scale, scores);
    return;
  }
#endif
  attend_generic(q, keys, values, out, group, head_dim, length, scale, scores);
}

}  // namespace

// q [B, heads, D]; k_new, v_new [B, kv_heads, D]; buffers: B tensors [L, 2, kv_heads, cap, D];
// positions[b]: where sequence b's new token goes. Returns [B, heads, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new,
                               std::vector<torch::Tensor> buffers, int64_t layer,
                               std::vector<int64_t> positions, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q: contiguous float32 [B, H, D]");
  TORCH_CHECK(k_new.is_contiguous() && v_new.is_contiguous(), "k_new, v_new: contiguous [B, KVH, D]");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_new.size(1), group = heads / kv_heads;
  TORCH_CHECK(static_cast<int64_t>(buffers.size()) == batch && static_cast<int64_t>(positions.size()) == batch,
              "one buffer and one position per sequence");
  TORCH_CHECK(heads % kv_heads == 0 && k_new.size(0) == batch && k_new.size(2) == head_dim, "shapes disagree");
  std::vector<float*> bases(batch);
  std::vector<int64_t> caps(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const auto& buf = buffers[b];
    TORCH_CHECK(buf.dtype() == torch::kFloat32 && buf.dim() == 5 && buf.size(2) == kv_heads &&
                buf.size(4) == head_dim && buf.stride(4) == 1 && buf.stride(3) == head_dim,
                "buffer ", b, ": float32 [L, 2, kv_heads, cap, head_dim] with contiguous rows");
    TORCH_CHECK(layer >= 0 && layer < buf.size(0), "layer out of range");
    TORCH_CHECK(positions[b] >= 0 && positions[b] < buf.size(3), "position ", positions[b], " outside buffer ", b);
    bases[b] = buf.data_ptr<float>();
    caps[b] = buf.stride(2);   // elements from one kv head's rows to the next's
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_new.data_ptr<float>();
  const float* vp = v_new.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, pos = positions[b];
      const auto& buf = buffers[b];
      float* keys = bases[b] + layer * buf.stride(0) + 0 * buf.stride(1) + h * caps[b];
      float* values = bases[b] + layer * buf.stride(0) + 1 * buf.stride(1) + h * caps[b];
      const float* kn = kp + (b * kv_heads + h) * head_dim;
      const float* vn = vp + (b * kv_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        keys[pos * head_dim + d] = kn[d];
        values[pos * head_dim + d] = vn[d];
      }
      scores.resize(group * (pos + 1));
      attend_one(qp + (b * heads + h * group) * head_dim, keys, values, op + (b * heads + h * group) * head_dim,
                 group, head_dim, pos + 1, s, scores.data());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "batched decode attention over per-sequence KV buffers, in place");
}
