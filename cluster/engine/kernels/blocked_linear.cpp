// A float32 linear for a few rows that gives MKL's large-batch numbers, bit for bit.
//
// y[M, N] = x[M, K] @ W^T for a weight W [N, K] packed once into column panels,
// ``panels`` [ceil(N / 64), K, 64] (panel p holds W^T's columns 64p..64p+63, zero past N),
// so that a panel streams from memory in one sequential read. MKL's sgemm
// sums each output over K in an order that, from some row count on (4 to 16 rows for
// the shapes of a small decoder), no longer depends on the row count: K cut into
// `parts` contiguous parts (as many as MKL's threads split it into), each part into
// balanced blocks of at most `kc` (MKL's K blocking); within a block one fused
// multiply-add after the other from zero, the blocks of a part added left to right,
// the parts added left to right. Below that row count MKL takes another path (and
// another order), and it reads the weights at a fraction of the memory's speed: this
// kernel reads them once a step for all rows, in the large-batch order at every row
// count. Whether the order above is MKL's on this machine, for these shapes and this
// thread count, is not assumed: the caller checks the kernel against MKL's result for
// a large batch and uses it only where they are equal bit for bit
// (cluster/engine/linear_layouts.py).
//
// Vectorised across N: each lane holds one output and runs its own chain of FMAs, so
// the vector width (AVX-512, AVX2, none) does not change a sum. Each panel is read once
// from memory for all rows (tiles of 4 rows reread it from the cache); ATen's threads
// take the panels (for a long prompt: a panel for some of its rows) one at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;   // columns of a panel
constexpr int64_t kSplitRows = 128, kChunkRows = 64;   // see blocked_linear's tasks

std::vector<int64_t> balanced(int64_t n, int64_t max_size) {
  const int64_t pieces = (n + max_size - 1) / max_size;
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < pieces; ++i) sizes.push_back(n / pieces + (i < n % pieces ? 1 : 0));
  return sizes;
}

// Every block's K range; whether it starts a part, ends one, and lies in the first part.
struct Block {
  int64_t begin, end;
  bool starts_part, ends_part, first_part;
};

std::vector<Block> blocks_of(int64_t K, int64_t parts, int64_t kc) {
  std::vector<Block> blocks;
  int64_t k = 0;
  bool first_part = true;
  for (int64_t part : balanced(K, (K + parts - 1) / parts)) {
    const std::vector<int64_t> sizes = balanced(part, kc);
    for (size_t i = 0; i < sizes.size(); ++i) {
      blocks.push_back({k, k + sizes[i], i == 0, i + 1 == sizes.size(), first_part});
      k += sizes[i];
    }
    first_part = false;
  }
  return blocks;
}

// One panel, every row: std::fma one output at a time (exact, slow: CPUs without AVX2).
void panel_generic(const float* x, const float* panel, float* y, int64_t M, int64_t K, int64_t ldy,
                   int64_t width, const std::vector<Block>& blocks) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < width; ++j) {
      float part = 0.f, total = 0.f;
      for (const Block& b : blocks) {
        float acc = 0.f;
        for (int64_t k = b.begin; k < b.end; ++k) acc = std::fma(x[m * K + k], panel[k * kPanel + j], acc);
        part = b.starts_part ? acc : part + acc;
        if (b.ends_part) total = b.first_part ? part : total + part;
      }
      y[m * ldy + j] = total;
    }
}

#if defined(__x86_64__)
// AVX-512: R rows x the panel's 64 columns (4 vectors) in registers, over K's range
// [k0, k1) of one block; the block's running sums wait in `acc` (R x 64) between ranges,
// and a block's last range adds them into the part's and the part's into the total.
template <int R>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, const float* panel, int64_t K, int64_t k0,
                                                     int64_t k1, const Block& b, float* acc_buf, float* part_buf,
                                                     float* total_buf, const float* ahead, int64_t tile,
                                                     int64_t tiles) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = k0 == b.begin ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_buf + r * kPanel + 16 * v);
  // The tiles of a range share asking for the next range's lines: this tile every
  // tiles-th row of it, spread over its own iterations.
  int64_t next = tile;
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = panel + k * kPanel;
    if (k - k0 == next) {
      for (int v = 0; v < 4; ++v) _mm_prefetch(reinterpret_cast<const char*>(ahead + next * kPanel + 16 * v),
                                               _MM_HINT_T0);
      next += tiles;
    }
    __m512 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) {
      const int64_t at = r * kPanel + 16 * v;
      if (k1 != b.end) { _mm512_storeu_ps(acc_buf + at, acc[r][v]); continue; }
      const __m512 part = b.starts_part ? acc[r][v] : _mm512_add_ps(_mm512_loadu_ps(part_buf + at), acc[r][v]);
      _mm512_storeu_ps(part_buf + at, part);
      if (b.ends_part)
        _mm512_storeu_ps(total_buf + at, b.first_part ? part : _mm512_add_ps(_mm512_loadu_ps(total_buf + at), part));
    }
}

// One panel, every row: K in ranges of kRange (a slice of the panel that stays in the L1
// cache), each range run for all the rows' tiles before the next, so the panel streams
// from memory once while the rows' FMAs run.
constexpr int64_t kRange = 48;

__attribute__((target("avx512f"))) void panel_avx512(const float* x, const float* panel, float* y, int64_t M,
                                                      int64_t K, int64_t ldy, int64_t width,
                                                      const std::vector<Block>& blocks, float* scratch) {
  float* acc_buf = scratch;               // M x 64 each
  float* part_buf = scratch + M * kPanel;
  float* total_buf = scratch + 2 * M * kPanel;
  for (const Block& b : blocks)
    for (int64_t k0 = b.begin; k0 < b.end; k0 += kRange) {
      const int64_t k1 = std::min(b.end, k0 + kRange);
      // The next range's lines (past K: the next panel's first, as the panels lie one after the other).
      const float* ahead = panel + k1 * kPanel;
      const int64_t tiles = (M + 3) / 4;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        tile_avx512<4>(x + m * K, panel, K, k0, k1, b, acc_buf + m * kPanel, part_buf + m * kPanel,
                       total_buf + m * kPanel, ahead, m / 4, tiles);
      switch (M - m) {
        case 3: tile_avx512<3>(x + m * K, panel, K, k0, k1, b, acc_buf + m * kPanel, part_buf + m * kPanel,
                               total_buf + m * kPanel, ahead, m / 4, tiles); break;
        case 2: tile_avx512<2>(x + m * K, panel, K, k0, k1, b, acc_buf + m * kPanel, part_buf + m * kPanel,
                               total_buf + m * kPanel, ahead, m / 4, tiles); break;
        case 1: tile_avx512<1>(x + m * K, panel, K, k0, k1, b, acc_buf + m * kPanel, part_buf + m * kPanel,
                               total_buf + m * kPanel, ahead, m / 4, tiles); break;
        default: break;
      }
    }
  for (int64_t r = 0; r < M; ++r) std::copy(total_buf + r * kPanel, total_buf + r * kPanel + width, y + r * ldy);
}

// AVX2 + FMA: R rows x 16 of the panel's columns (2 vectors) in registers, four times a panel.
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, const float* panel, float* out, int64_t K,
                                                    const std::vector<Block>& blocks) {
  __m256 part[R][2], total[R][2];
  for (const Block& b : blocks) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = b.begin; k < b.end; ++k) {
      const float* w = panel + k * kPanel;
      const __m256 wv[2] = {_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)};
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(x[r * K + k]);
        for (int v = 0; v < 2; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) {
        part[r][v] = b.starts_part ? acc[r][v] : _mm256_add_ps(part[r][v], acc[r][v]);
        if (b.ends_part) total[r][v] = b.first_part ? part[r][v] : _mm256_add_ps(total[r][v], part[r][v]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + r * kPanel + 8 * v, total[r][v]);
}

__attribute__((target("avx2,fma"))) void panel_avx2(const float* x, const float* panel, float* y, int64_t M,
                                                     int64_t K, int64_t ldy, int64_t width,
                                                     const std::vector<Block>& blocks) {
  float out[4 * kPanel];   // a tile's rows, then the valid columns to y
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t rows = std::min<int64_t>(4, M - m);
    for (int64_t c = 0; c < kPanel; c += 16) {
      switch (rows) {
        case 4: tile_avx2<4>(x + m * K, panel + c, out + c, K, blocks); break;
        case 3: tile_avx2<3>(x + m * K, panel + c, out + c, K, blocks); break;
        case 2: tile_avx2<2>(x + m * K, panel + c, out + c, K, blocks); break;
        default: tile_avx2<1>(x + m * K, panel + c, out + c, K, blocks); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) std::copy(out + r * kPanel, out + r * kPanel + width, y + (m + r) * ldy);
  }
}
#endif

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

}  // namespace

// W [N, K] -> its column panels [ceil(N / 64), K, 64], zero past N.
torch::Tensor pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack_panels: a float32 CPU weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  torch::Tensor padded = torch::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// y = x @ W^T over W's panels, in the order described above; x [M, K] float32, n = N.
// With ``residual`` ([M, n], float32): residual + x @ W^T, added in one pass after the product
// (one rounding, as ``residual + y`` in torch: the same bits), inside the one call.
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, int64_t parts,
                             int64_t kc, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel && x.size(1) == panels.size(1),
              "blocked_linear: x [M, K], panels [P, K, 64]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && panels.scalar_type() == torch::kFloat32,
              "blocked_linear: float32");
  TORCH_CHECK(x.device().is_cpu() && panels.is_contiguous(), "blocked_linear: CPU tensors, contiguous panels");
  TORCH_CHECK(parts >= 1 && kc >= 1 && n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "blocked_linear: parts, kc >= 1 and n within the panels");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0);
  torch::Tensor y = torch::empty({M, n}, xc.options());
  torch::Tensor rc;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 && residual->dim() == 2 && residual->size(0) == M &&
                residual->size(1) == n && residual->device().is_cpu(), "blocked_linear: residual float32 [M, n]");
    rc = residual->contiguous();
  }
  if (M == 0) return y;
  const float* rp = rc.defined() ? rc.data_ptr<float>() : nullptr;
  TORCH_CHECK(K > 0, "blocked_linear: K >= 1");
  const std::vector<Block> blocks = blocks_of(K, std::min(parts, K), kc);
  static const Isa isa = best_isa();
  const float* xp = xc.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Work goes out one task at a time (an atomic counter, not ATen's static halves): a
  // thread the OS preempts (a wake-up of another process on its core) holds up only the
  // task it is on while the other threads take the rest, instead of its whole half. A task
  // is one panel for all rows; from kSplitRows rows on (a prompt's chunk: compute-bound,
  // the panel rereads come from the core's cache) one panel for kChunkRows of them, so a
  // layer of a few panels (9 for a 576-wide output) still splits evenly between threads.
  // Each output's sum is the same whichever task computes it.
  const int64_t chunk = M >= kSplitRows ? kChunkRows : M;
  const int64_t chunks = (M + chunk - 1) / chunk, tasks = P * chunks;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(isa == Isa::kAvx512 ? 3 * chunk * kPanel : 0);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t p = t / chunks, m0 = (t % chunks) * chunk, rows = std::min(chunk, M - m0);
      const int64_t width = std::min(kPanel, n - p * kPanel);
      const float* panel = pp + p * K * kPanel;
      const float* xc_rows = xp + m0 * K;
      float* yc = yp + m0 * n + p * kPanel;
#if defined(__x86_64__)
      if (isa == Isa::kAvx512) {
        panel_avx512(xc_rows, panel, yc, rows, K, n, width, blocks, scratch.data());
        continue;
      }
      if (isa == Isa::kAvx2) { panel_avx2(xc_rows, panel, yc, rows, K, n, width, blocks); continue; }
#endif
      panel_generic(xc_rows, panel, yc, rows, K, n, width, blocks);
    }
  });
  if (rp != nullptr) {
    float* yp_all = y.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        for (int64_t j = 0; j < n; ++j) yp_all[m * n + j] = rp[m * n + j] + yp_all[m * n + j];
    });
  }
  return y;
}

std::string isa_name() {
  switch (best_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

// layers.cpp builds this file into its own module, without this one's bindings.
#ifndef PREFIX_CACHE_NO_BINDINGS
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "a weight [N, K] as column panels [ceil(N / 64), K, 64]");
  // The GIL is released while a kernel runs (as torch's own ops do): the replica's event loop
  // thread streams tokens beside the forward instead of waiting for it between two ops.
  m.def("blocked_linear", &blocked_linear, "x @ W^T over W's panels in MKL's large-batch order (float32, CPU)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("parts"), pybind11::arg("kc"),
        pybind11::arg("residual") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isa", &isa_name, "the instruction set blocked_linear runs on this CPU");
}
#endif
