// Prefill attention on the CPU: one prompt chunk's causal attention over its sequence's
// keys (the cached prefix and the chunk's own), float32, head_dim 64, in one pass (flash
// attention: an online softmax over blocks of keys, nothing of the scores kept).
//
// The work is split into tasks of (KV head, tile of query tokens); a task's rows are the
// tile's tokens times the query heads of its KV head (grouped-query attention: the group
// shares each key and value it loads). Per block of keys a task computes its rows' scores
// (a register-tiled product over the block's keys, transposed once a call so the keys lie
// along the vector lanes), folds them into each row's running maximum and sum, and adds the
// block's values weighted by them (a register-tiled product along head_dim). A row sees the
// keys up to its own position: whole blocks past a tile's last position are never touched,
// and the diagonal block masks per row. Tasks go out one at a time from an atomic counter,
// the longest first, so the threads end together.
//
// SDPA's CPU flash kernel computes the same in small GEMM calls (about 60 GFLOPS a core
// here); a cached prefix needs it twice and a merge. The results equal a float64 softmax
// to float32 rounding (tests/unit/test_prefill_attention.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kDim = 64;         // head_dim of the vector path: four 16-float vectors
constexpr int64_t kTileTokens = 16;  // query tokens per task
constexpr int64_t kBlock = 64;       // keys per block
constexpr int64_t kRows = 6;         // rows per register tile: 24 accumulators, 4 loads, 1 broadcast
constexpr int64_t kMaxGroup = 8;     // query heads per KV head a task's buffers hold

bool has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

#if defined(__x86_64__)
// exp of sixteen floats: Cephes' expf (as exp256 in decode_attention.cpp), within about
// 1 ulp of libm's expf; inputs below -88.38 give about 0 (callers mask what must be 0).
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-88.3762626647949f), hi = _mm512_set1_ps(88.3762626647949f);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// s[r][0..64) = q[r] . keys j0..j0+64 for R rows: kt holds the keys transposed (row d is
// every key's component d, ld_kt apart), so each step of d is four vector loads shared by
// the R rows and one broadcast per row.
template <int R>
__attribute__((target("avx512f"))) inline void score_tile(const float* q, const float* kt, int64_t ld_kt, float* s) {
  __m512 acc[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kDim; ++d) {
    const float* row = kt + d * ld_kt;
    const __m512 k0 = _mm512_loadu_ps(row), k1 = _mm512_loadu_ps(row + 16);
    const __m512 k2 = _mm512_loadu_ps(row + 32), k3 = _mm512_loadu_ps(row + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r * kDim + d]);
      acc[r][0] = _mm512_fmadd_ps(b, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(b, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(b, k3, acc[r][3]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kBlock + 16 * c, acc[r][c]);
}

// o[r] += sum over the block's nk keys of p[r][j] * v[j], for R rows (v rows kDim apart).
template <int R>
__attribute__((target("avx512f"))) inline void value_tile(const float* p, const float* v, int64_t nk, float* o) {
  __m512 acc[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * kDim + 16 * c);
  for (int64_t j = 0; j < nk; ++j) {
    const float* row = v + j * kDim;
    const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16);
    const __m512 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(p[r * kBlock + j]);
      acc[r][0] = _mm512_fmadd_ps(b, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(b, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(b, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(b, v3, acc[r][3]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * kDim + 16 * c, acc[r][c]);
}

__attribute__((target("avx512f"))) void scores(const float* q, const float* kt, int64_t ld_kt, float* s,
                                               int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) score_tile<kRows>(q + r * kDim, kt, ld_kt, s + r * kBlock);
  switch (rows - r) {
    case 1: score_tile<1>(q + r * kDim, kt, ld_kt, s + r * kBlock); break;
    case 2: score_tile<2>(q + r * kDim, kt, ld_kt, s + r * kBlock); break;
    case 3: score_tile<3>(q + r * kDim, kt, ld_kt, s + r * kBlock); break;
    case 4: score_tile<4>(q + r * kDim, kt, ld_kt, s + r * kBlock); break;
    case 5: score_tile<5>(q + r * kDim, kt, ld_kt, s + r * kBlock); break;
    default: break;
  }
}

__attribute__((target("avx512f"))) void values(const float* p, const float* v, int64_t nk, float* o, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) value_tile<kRows>(p + r * kBlock, v, nk, o + r * kDim);
  switch (rows - r) {
    case 1: value_tile<1>(p + r * kBlock, v, nk, o + r * kDim); break;
    case 2: value_tile<2>(p + r * kBlock, v, nk, o + r * kDim); break;
    case 3: value_tile<3>(p + r * kBlock, v, nk, o + r * kDim); break;
    case 4: value_tile<4>(p + r * kBlock, v, nk, o + r * kDim); break;
    case 5: value_tile<5>(p + r * kBlock, v, nk, o + r * kDim); break;
    default: break;
  }
}

// One row's scores of a block (its first `visible` keys count, the rest become 0) into
// weights against the row's running maximum and sum; its output so far rescaled.
__attribute__((target("avx512f"))) void online_softmax(float* s, int64_t visible, float& top, float& sum, float* o) {
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = neg;
  for (int c = 0; c < 4; ++c) {
    const int64_t left = visible - 16 * c;
    if (left <= 0) break;
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_loadu_ps(s + 16 * c));
  }
  const float block_top = _mm512_reduce_max_ps(mv);
  const float new_top = std::max(top, block_top);
  const float alpha = std::exp(top - new_top);   // 0 at the first block (top is -inf)
  const __m512 topv = _mm512_set1_ps(new_top);
  __m512 sv = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const int64_t left = visible - 16 * c;
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * c), topv)));
    _mm512_storeu_ps(s + 16 * c, e);
    sv = _mm512_add_ps(sv, e);
  }
  sum = sum * alpha + _mm512_reduce_add_ps(sv);
  top = new_top;
  if (alpha != 1.f) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), av));
  }
}

// The keys transposed a block of 64 at a time, [kv_heads, 64, ld_kt], zero past the last
// key; a block is turned by the first task that asks for it (state 0 -> 1 -> 2), the others
// wait the few microseconds that takes.
struct TransposedKeys {
  const float* src;   // [kv_heads, keys, 64]
  float* kt;
  int64_t keys, ld_kt, blocks;
  std::atomic<int>* state;

  const float* block(int64_t h, int64_t b) {
    float* dst = kt + h * kDim * ld_kt + b * kBlock;
    std::atomic<int>& st = state[h * blocks + b];
    int expected = 0;
    if (st.load(std::memory_order_acquire) != 2 && st.compare_exchange_strong(expected, 1)) {
      const int64_t j0 = b * kBlock, n = std::min(kBlock, keys - j0);
      const float* from = src + (h * keys + j0) * kDim;
      for (int64_t d = 0; d < kDim; ++d) {
        float* row = dst + d * ld_kt;
        for (int64_t j = 0; j < n; ++j) row[j] = from[j * kDim + d];
        for (int64_t j = n; j < kBlock; ++j) row[j] = 0.f;
      }
      st.store(2, std::memory_order_release);
    }
    while (st.load(std::memory_order_acquire) != 2) std::this_thread::yield();
    return dst;
  }
};

struct Shape {
  int64_t tokens, heads, kv_heads, group, keys, ld_kt, start;
  float scale;
};

// One task: the query tokens [t0, t0 + nt) of KV head h, every query head of its group.
__attribute__((target("avx512f"))) void attend_tile(const Shape& sh, const float* q, TransposedKeys& kt, const float* v,
                                                    float* out, int64_t h, int64_t t0, float* qs, float* s, float* o,
                                                    float* top, float* sum) {
  const int64_t nt = std::min(kTileTokens, sh.tokens - t0), g = sh.group, rows = nt * g;
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t k = 0; k < g; ++k) {
      const float* src = q + ((t0 + t) * sh.heads + h * g + k) * kDim;
      float* dst = qs + (t * g + k) * kDim;
      for (int64_t d = 0; d < kDim; ++d) dst[d] = src[d] * sh.scale;
    }
  std::fill(o, o + rows * kDim, 0.f);
  std::fill(top, top + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.f);
  const int64_t first = sh.start + t0, seen = first + nt;   // the tile's first position; keys it sees
  const float* vh = v + h * sh.keys * kDim;
  for (int64_t j0 = 0; j0 < seen; j0 += kBlock) {
    const int64_t nk = std::min(kBlock, seen - j0);
    scores(qs, kt.block(h, j0 / kBlock), sh.ld_kt, s, rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(nk, first + r / g + 1 - j0);   // keys up to the row's own position
      online_softmax(s + r * kBlock, visible, top[r], sum[r], o + r * kDim);
    }
    values(s, vh + j0 * kDim, nk, o, rows);
  }
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t k = 0; k < g; ++k) {
      const int64_t r = t * g + k;
      const float inv = 1.f / sum[r];
      float* dst = out + ((t0 + t) * sh.heads + h * g + k) * kDim;
      for (int64_t d = 0; d < kDim; ++d) dst[d] = o[r * kDim + d] * inv;
    }
}
#endif

}  // namespace

// q [T, heads, 64] at positions start..start+T-1; keys, values [kv_heads, start + T, 64]
// (head-major, the sequence's cached prefix then the chunk's own); float32 CPU tensors.
// Returns the attention output [T, heads, 64]: query token i sees keys 0..start+i.
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                int64_t start, double scale) {
  TORCH_CHECK(has_avx512(), "prefill_attention: needs AVX-512");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(),
              "prefill_attention: q [T, heads, 64], keys and values [kv_heads, positions, 64]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
              values.scalar_type() == torch::kFloat32 && q.device().is_cpu() && keys.device().is_cpu() &&
              values.device().is_cpu(), "prefill_attention: float32 CPU tensors");
  const int64_t T = q.size(0), heads = q.size(1), kv_heads = keys.size(0), S = keys.size(1);
  TORCH_CHECK(q.size(2) == kDim && keys.size(2) == kDim, "prefill_attention: head_dim 64");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "prefill_attention: query heads a multiple of the KV heads, at most 8 per KV head");
  TORCH_CHECK(start >= 0 && S == start + T, "prefill_attention: keys must hold start + T positions");
  torch::Tensor out = torch::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
#if defined(__x86_64__)
  const torch::Tensor qc = q.contiguous(), vc = values.contiguous();
  const int64_t ld_kt = (S + kBlock - 1) / kBlock * kBlock;
  // The keys transposed, [kv_heads, 64, ld_kt], zero past S (a block's loads stay inside):
  // each block of 64 keys turned by the first task that needs it (one parallel region a
  // call: a region costs a wake-up of every thread, a scheduler slice on a busy machine).
  const torch::Tensor kc = keys.contiguous();
  torch::Tensor kt = torch::empty({kv_heads, kDim, ld_kt}, q.options());
  const int64_t key_blocks = ld_kt / kBlock;
  std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[kv_heads * key_blocks]);
  for (int64_t b = 0; b < kv_heads * key_blocks; ++b) state[b].store(0, std::memory_order_relaxed);
  TransposedKeys keys_t{kc.data_ptr<float>(), kt.data_ptr<float>(), S, ld_kt, key_blocks, state.get()};
  const Shape sh{T, heads, kv_heads, heads / kv_heads, S, ld_kt, start, static_cast<float>(scale)};
  const int64_t tiles = (T + kTileTokens - 1) / kTileTokens, tasks = tiles * kv_heads;
  const float* qp = qc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t rows = kTileTokens * kMaxGroup;
    std::vector<float> buf(rows * kDim * 2 + rows * kBlock + 2 * rows);
    float *qs = buf.data(), *o = qs + rows * kDim, *s = o + rows * kDim, *top = s + rows * kBlock, *sum = top + rows;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t tile = tiles - 1 - task / kv_heads;   // the longest rows first
      attend_tile(sh, qp, keys_t, vp, op, task % kv_heads, tile * kTileTokens, qs, s, o, top, sum);
    }
  });
#endif
  return out;
}

bool available() { return has_avx512(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a prompt chunk over its sequence's head-major K/V (float32, head_dim 64)");
  m.def("available", &available, "whether this CPU runs prefill_attention (AVX-512)");
}
