// Decode attention for a batch of sequences, in place in a slotted KV pool.
//
// One call per layer for every sequence of a step that decodes one token, or adds a
// few (a later turn's new tokens after its cached prefix): the tokens' K and V are
// written into the pool [blocks, layers, 2, block_tokens, kv_heads, head_dim] at their
// slots (a slot: block * block_tokens + offset; each sequence's positions listed in its
// slot table), then each query head of each new token attends over its sequence's keys
// up to its own position, reached through the table (a KV head's key row is read once
// for the whole group of query heads). Work is split over (sequence, kv head) items,
// handed to ATen's threads one at a time. Float32 only;
// dot products and the softmax in float32, as the reference matmul path. On AVX2
// the softmax runs eight lanes at a time with a vector exp (Cephes' expf, as ATen's
// own vectorized softmax does with Sleef's): libm's scalar exp was a third of the
// kernel (16 sequences x 800 positions x 30 layers: 54 -> 36 ms a step).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// A sequence's rows in the pool: a row's place is its slot's element offset (block * block
// stride + offset in block * token stride), the same for every layer and head, so one table
// of offsets serves the whole call; rows need not be contiguous.
struct PagedRows {
  const float* keys;     // the pool at this layer and KV head, K
  const float* values;   // ... and V
  const int64_t* offs;   // per position of the sequence: its slot's element offset
  const float* key(int64_t s) const { return keys + offs[s]; }
  const float* value(int64_t s) const { return values + offs[s]; }
};

void attend_generic(const float* q, const PagedRows& rows, float* out, int64_t group,
                    int64_t head_dim, int64_t length, float scale, float* scores) {
  // scores[g * length + s] = q_g . k_s * scale
  for (int64_t s = 0; s < length; ++s) {
    const float* k = rows.key(s);
    for (int64_t g = 0; g < group; ++g) {
      // Eight partial sums in a fixed pattern, not a vectorizer's reduction: that one peels
      // elements to align the loads, so its order (and last bits) would follow the address.
      const float* qg = q + g * head_dim;
      float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t d = 0;
      for (; d + 8 <= head_dim; d += 8) {
#pragma omp simd
        for (int j = 0; j < 8; ++j) lanes[j] += qg[d + j] * k[d + j];
      }
      for (; d < head_dim; ++d) lanes[d & 7] += qg[d] * k[d];
      const float acc = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
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
      const float* v = rows.value(s);
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

// exp of eight floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5
// polynomial, the exponent built in the bits), within about 1 ulp of libm's expf, as the
// vectorized exp ATen's softmax uses. Inputs below -88.38 give 0 (softmax inputs are <= 0).
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f), hi = _mm256_set1_ps(88.3762626647949f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// softmax_rows with eight lanes at a time (max, exp and sum, scale); the tail of each row
// goes through the same exp on a padded vector, so every element sees one exp.
__attribute__((target("avx2,fma")))
void softmax_rows_avx2(float* scores, int64_t rows, int64_t length) {
  for (int64_t g = 0; g < rows; ++g) {
    float* row = scores + g * length;
    float top = row[0];
    int64_t s = 0;
    if (length >= 8) {
      __m256 m = _mm256_loadu_ps(row);
      for (s = 8; s + 8 <= length; s += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + s));
      float lanes[8];
      _mm256_storeu_ps(lanes, m);
      for (float v : lanes) top = v > top ? v : top;
    }
    for (; s < length; ++s) top = row[s] > top ? row[s] : top;
    const __m256 topv = _mm256_set1_ps(top);
    __m256 sumv = _mm256_setzero_ps();
    for (s = 0; s + 8 <= length; s += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + s), topv));
      _mm256_storeu_ps(row + s, e);
      sumv = _mm256_add_ps(sumv, e);
    }
    float sum = hsum(sumv);
    if (s < length) {
      float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t t = s; t < length; ++t) tail[t - s] = row[t] - top;
      float out[8];
      _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(tail)));
      for (int64_t t = s; t < length; ++t) {
        row[t] = out[t - s];
        sum += out[t - s];
      }
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (s = 0; s + 8 <= length; s += 8) _mm256_storeu_ps(row + s, _mm256_mul_ps(_mm256_loadu_ps(row + s), inv));
    for (; s < length; ++s) row[s] *= 1.f / sum;
  }
}

// head_dim == 64: each row of keys and values is eight 8-float vectors. Each key's score is
// its own accumulation and the values are summed in position order, so the results do not
// depend on which slots a sequence's rows live in.
__attribute__((target("avx2,fma")))
void attend_avx2_64(const float* q, const PagedRows& rows, float* out, int64_t group,
                    int64_t length, float scale, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * 64;
    __m256 qv[8];
    for (int j = 0; j < 8; ++j) qv[j] = _mm256_loadu_ps(qg + 8 * j);
    float* row = scores + g * length;
    int64_t s = 0;
    for (; s + 4 <= length; s += 4) {   // four keys at a time: four independent accumulations
      const float *k0 = rows.key(s), *k1 = rows.key(s + 1), *k2 = rows.key(s + 2),
                  *k3 = rows.key(s + 3);
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) {
        a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + 8 * j), a0);
        a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k1 + 8 * j), a1);
        a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k2 + 8 * j), a2);
        a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k3 + 8 * j), a3);
      }
      row[s] = hsum(a0) * scale;
      row[s + 1] = hsum(a1) * scale;
      row[s + 2] = hsum(a2) * scale;
      row[s + 3] = hsum(a3) * scale;
    }
    for (; s < length; ++s) {
      const float* k = rows.key(s);
      __m256 a = _mm256_setzero_ps();
      for (int j = 0; j < 8; ++j) a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a);
      row[s] = hsum(a) * scale;
    }
  }
  softmax_rows_avx2(scores, group, length);
  for (int64_t g = 0; g < group; ++g) {
    const float* row = scores + g * length;
    __m256 o[8];
    for (int j = 0; j < 8; ++j) o[j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < length; ++s) {   // in position order, wherever the rows lie
      const __m256 p = _mm256_set1_ps(row[s]);
      const float* v = rows.value(s);
      for (int j = 0; j < 8; ++j) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), o[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + g * 64 + 8 * j, o[j]);
  }
}
#endif

void attend_one(const float* q, const PagedRows& rows, float* out, int64_t group,
                int64_t head_dim, int64_t length, float scale, float* scores) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && head_dim == 64) {
    attend_avx2_64(q, rows, out, group, length, scale, scores);
    return;
  }
#endif
  attend_generic(q, rows, out, group, head_dim, length, scale, scores);
}

}  // namespace

// A step's slot tables in a slotted KV pool [blocks, layers, 2, block_tokens, kv_heads,
// head_dim]: per sequence b, the pool slot (block * block_tokens + offset) of each of its
// positions[b] + counts[b] positions, concatenated in ``slots`` from starts[b] on. Checked
// and turned into element offsets once (a step's layers share them).
struct SlotTable {
  std::vector<int64_t> offs;      // per entry of ``slots``: block * stride(0) + offset * stride(3)
  std::vector<int64_t> starts;    // per sequence, its first entry (batch + 1 values)
  std::vector<int64_t> positions, counts;
  int64_t layers, kv_heads, head_dim, s_layer, s_kv, s_head;
  float* base;
};

SlotTable slot_table(const torch::Tensor& pool, const torch::Tensor& slots, std::vector<int64_t> starts,
                     std::vector<int64_t> positions, std::vector<int64_t> counts) {
  TORCH_CHECK_VALUE(pool.dtype() == torch::kFloat32 && pool.dim() == 6 && pool.size(2) == 2 && pool.stride(5) == 1 &&
                    pool.device().is_cpu(),
                    "pool: float32 CPU [blocks, layers, 2, block_tokens, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK_VALUE(slots.dtype() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() &&
                    slots.device().is_cpu(), "slots: a contiguous 1-D int64 CPU tensor");
  const int64_t batch = static_cast<int64_t>(positions.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(counts.size()) == batch && static_cast<int64_t>(starts.size()) == batch + 1 &&
                    starts[0] == 0 && starts[batch] == slots.numel(),
                    "one position and count per sequence, starts: batch + 1 offsets from 0 to len(slots)");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(positions[b] >= 0 && counts[b] >= 0 && starts[b + 1] - starts[b] == positions[b] + counts[b],
                      "sequence ", b, ": ", starts[b + 1] - starts[b], " slots for ", positions[b], " + ", counts[b],
                      " positions");
  const int64_t block_tokens = pool.size(3), capacity = pool.size(0) * block_tokens;
  const int64_t* sp = slots.data_ptr<int64_t>();
  SlotTable t{std::vector<int64_t>(slots.numel()), std::move(starts), std::move(positions), std::move(counts),
              pool.size(1), pool.size(4), pool.size(5), pool.stride(1), pool.stride(2), pool.stride(4),
              pool.data_ptr<float>()};
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK_VALUE(sp[i] >= 0 && sp[i] < capacity, "slot ", sp[i], " outside the pool's ", capacity);
  const int64_t s_block = pool.stride(0), s_token = pool.stride(3);
  if ((block_tokens & (block_tokens - 1)) == 0) {   // a shift and a mask, not a division per slot
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(block_tokens));
    for (int64_t i = 0; i < slots.numel(); ++i)
      t.offs[i] = (sp[i] >> shift) * s_block + (sp[i] & (block_tokens - 1)) * s_token;
  } else {
    for (int64_t i = 0; i < slots.numel(); ++i)
      t.offs[i] = (sp[i] / block_tokens) * s_block + (sp[i] % block_tokens) * s_token;
  }
  return t;
}

// q [T, heads, D]; k_new, v_new [T, kv_heads, D]: the new tokens of the table's sequences one
// after the other, counts[b] of sequence b (T their sum), at positions[b].. of its slot
// table; each token's heads contiguous, any stride from one token to the next (the q, k and
// v columns of the fused qkv output, uncopied). The new tokens' K/V are written at their
// slots, each new token attending causally over its sequence's slots up to its own
// position; the order of the arithmetic does not depend on where the slots lie. Sequences
// may share slots they read (a common prefix, read from memory once a layer for all of
// them); the caller sees to it that no slot one writes is another's. Returns [T, heads, D].
torch::Tensor attend_slots(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                           const SlotTable& t, int64_t layer, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_new.dtype() == torch::kFloat32 && v_new.dtype() == torch::kFloat32 &&
              q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "q, k_new, v_new: float32 [T, heads, D]");
  const int64_t total = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = t.kv_heads;
  for (const auto* x : {&q, &k_new, &v_new})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == head_dim, "q, k_new, v_new: each token's heads contiguous");
  TORCH_CHECK(head_dim == t.head_dim && k_new.size(1) == kv_heads && heads % kv_heads == 0 &&
              k_new.size(0) == total && v_new.size(0) == total && v_new.size(1) == kv_heads, "shapes disagree");
  TORCH_CHECK(layer >= 0 && layer < t.layers, "layer out of range");
  const int64_t batch = static_cast<int64_t>(t.positions.size()), group = heads / kv_heads;
  std::vector<int64_t> rows_at(batch);
  int64_t offset = 0;
  for (int64_t b = 0; b < batch; ++b) {
    rows_at[b] = offset;
    offset += t.counts[b];
  }
  TORCH_CHECK(offset == total, "the counts add up to ", offset, ", not to q's ", total, " rows");
  auto out = torch::empty({total, heads, head_dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_new.data_ptr<float>();
  const float* vp = v_new.data_ptr<float>();
  const int64_t q_row = q.stride(0), k_row = k_new.stride(0), v_row = v_new.stride(0);
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // (sequence, KV head) items are handed out one at a time (an atomic counter, not ATen's
  // static halves): a thread the OS preempts holds up only the item it is on.
  const int64_t items = batch * kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = i / kv_heads, h = i % kv_heads, pos = t.positions[b];
      float* keys = t.base + layer * t.s_layer + h * t.s_head;
      float* values = keys + t.s_kv;
      const int64_t* offs = t.offs.data() + t.starts[b];
      for (int64_t n = 0; n < t.counts[b]; ++n) {   // the new tokens' K and V into their slots
        const int64_t row = rows_at[b] + n;
        std::copy_n(kp + row * k_row + h * head_dim, head_dim, keys + offs[pos + n]);
        std::copy_n(vp + row * v_row + h * head_dim, head_dim, values + offs[pos + n]);
      }
      const PagedRows rows{keys, values, offs};
      scores.resize(group * (pos + t.counts[b]));
      for (int64_t n = 0; n < t.counts[b]; ++n) {   // token n sees positions 0..pos + n
        const int64_t row = rows_at[b] + n;
        attend_one(qp + row * q_row + h * group * head_dim, rows, op + (row * heads + h * group) * head_dim,
                   group, head_dim, pos + n + 1, s, scores.data());
      }
    }
  });
  return out;
}

// One layer's batched attention over a slotted pool (see SlotTable and attend_slots).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor pool,
                              int64_t layer, torch::Tensor slots, std::vector<int64_t> starts,
                              std::vector<int64_t> positions, std::vector<int64_t> counts, double scale) {
  return attend_slots(q, k_new, v_new, slot_table(pool, slots, std::move(starts), std::move(positions),
                                                 std::move(counts)), layer, scale);
}

// RMSNorm over the last dimension, float32, as the packed decoder's torch path computes it
// (y = weight * (x * 1 / sqrt(mean(x^2) + eps))) in one call instead of five ops: at a
// decode step's few rows each op's dispatch costs more than its arithmetic (61 norms a
// step for a 30-layer model). The sum of squares runs in eight fixed lanes, so a row's
// result does not depend on its address; rows are split over ATen's threads from 64 on.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(!x.is_cuda() && !weight.is_cuda(), "rms_norm: CPU tensors only");
  const int64_t d = x.size(-1);
  // weight: [d], or [..., d] matching x's trailing dimensions (per-head weights: q_norm's
  // rows then k_norm's, over q and k side by side); row r uses weight row r mod its rows.
  TORCH_CHECK(weight.dim() >= 1 && weight.dim() <= x.dim() &&
              x.sizes().slice(x.dim() - weight.dim()).equals(weight.sizes()),
              "rms_norm: weight must be [", d, "] or x's trailing dimensions, got ", weight.sizes());
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = d ? xc.numel() / d : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t weight_rows = d ? wc.numel() / d : 1;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      const float* wr = wp + (r % weight_rows) * d;
      float* yr = op + r * d;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += xr[i + l] * xr[i + l];
      for (; i < d; ++i) lanes[i % 8] += xr[i] * xr[i];
      const float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + e);
      for (int64_t j = 0; j < d; ++j) yr[j] = wr[j] * (xr[j] * inv);
    }
  });
  return out;
}

// Rotary embedding of x [N, heads, head_dim] (rows' last dimension contiguous, any row
// strides: the q/k columns of the fused qkv output) with cos, sin [N, 1, head_dim]:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], into a new contiguous
// tensor, in one call instead of six ops.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope: x must be [N, heads, head_dim] with contiguous rows");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "rope: head_dim must be even");
  auto c = cos.reshape({n, d}).contiguous();
  auto sn = sin.reshape({n, d}).contiguous();
  auto out = torch::empty({n, heads, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, n * heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads, h = r % heads;
      const float* xr = xp + t * s0 + h * s1;
      const float* cr = cp + t * d;
      const float* sr = sp + t * d;
      float* yr = op + r * d;
      for (int64_t j = 0; j < half; ++j) {
        const float a = xr[j] * cr[j];
        const float b = -xr[j + half] * sr[j];
        yr[j] = a + b;
      }
      for (int64_t j = half; j < d; ++j) {
        const float a = xr[j] * cr[j];
        const float b = xr[j - half] * sr[j];
        yr[j] = a + b;
      }
    }
  });
  return out;
}

// layers.cpp builds this file into its own module, without this one's bindings.
#ifndef PREFIX_CACHE_NO_BINDINGS
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a kernel runs (as torch's own ops do): the replica's event loop
  // thread streams tokens beside the forward instead of waiting for it between two ops.
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("rope", &rope, "rotary embedding (float32, CPU)", pybind11::arg("x"), pybind11::arg("cos"),
        pybind11::arg("sin"), release_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32, CPU)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), release_gil());
  m.def("paged_attention", &paged_attention,
        "batched causal attention of a few new tokens per sequence over a slotted KV pool, through slot tables",
        pybind11::arg("q"), pybind11::arg("k_new"), pybind11::arg("v_new"), pybind11::arg("pool"),
        pybind11::arg("layer"), pybind11::arg("slots"), pybind11::arg("starts"), pybind11::arg("positions"),
        pybind11::arg("counts"), pybind11::arg("scale"), release_gil());
}
#endif
