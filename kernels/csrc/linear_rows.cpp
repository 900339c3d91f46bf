// A few activation rows (decode: one per live slot) times a compute-dtype weight [N, K], for CPUs where torch's
// low-precision GEMV streams the weight well under the memory bandwidth (no units for the dtype; or a few rows
// against oneDNN's bf16 kernels). Here each weight row is read once and dotted with every activation row while it is
// in L1 (gemv.h: widened a vector at a time, each widened vector used for a group of activation rows, four FMA chains
// per row, fp32 sums; bf16 on AVX-512 bf16: vdpbf16ps; on AMX: tiles, below); each output is rounded once to x's
// dtype, as torch's GEMM rounds it. A row's result does not depend on how many rows came with it.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx.h"

#include "gemv.h"  // (immintrin.h with it on AVX-512)

namespace {

constexpr int64_t GRAIN = 256;  // weight rows per task at least
constexpr int64_t MAX_ROWS = 16;

template <typename T>
void rows(const T* w, const float* x, float* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t m = 0;
#if defined(K3_LANES)
      if constexpr (!std::is_same_v<T, float>) {  // a widened vector of the row serves GROUP rows of x at once
        for (; m + k3::GROUP <= M; m += k3::GROUP)
          k3::dots_widened<k3::GROUP>(w + r * K, x + m * K, K, K, y + m * N + r, N);
      }
#endif
      for (; m < M; ++m) y[m * N + r] = k3::dot(w + r * K, x + m * K, K);
    }
  });
}

#if defined(__AVX512BF16__)
// On CPUs with AVX-512 bf16 dot products: bf16 rows of x (exact, as they come) against the bf16 weight, 32 products a
// instruction summed in fp32 (vdpbf16ps: no widening, half the instructions of the widened dot). G rows of x share
// each loaded vector of the weight; every row sums in two chains in the same order whatever G is, so a row's result
// does not depend on the rows that came with it.
inline __m512bh load_bf16(const c10::BFloat16* p, int64_t n) {  // up to 32 bf16, zeros past n (none for n <= 0)
  const __mmask32 m = n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1;
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// R weight rows (K apart) by G rows of x: their loads interleaved, so R streams from the memory are in flight (a
// batch of one or two rows needs four to read near the memory's rate). Each (weight row, x row) sums in two chains,
// the even 32 values and the odd, whatever R and G are.
template <int R, int G>
inline void dots_bf16(const c10::BFloat16* w, const c10::BFloat16* x, int64_t K, c10::BFloat16* y, int64_t N) {
  __m512 a0[R][G], a1[R][G];
#pragma GCC unroll 4
  for (int j = 0; j < R; ++j)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a0[j][g] = a1[j][g] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= K; i += 64) {
#pragma GCC unroll 4
    for (int j = 0; j < R; ++j) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w + j * K + i);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w + j * K + i + 32);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        a0[j][g] = _mm512_dpbf16_ps(a0[j][g], (__m512bh)_mm512_loadu_si512(x + g * K + i), v0);
        a1[j][g] = _mm512_dpbf16_ps(a1[j][g], (__m512bh)_mm512_loadu_si512(x + g * K + i + 32), v1);
      }
    }
  }
  if (i < K) {  // the row's last 1-63 values: the first 32 into chain 0, the rest into chain 1
#pragma GCC unroll 4
    for (int j = 0; j < R; ++j) {
      const __m512bh v0 = load_bf16(w + j * K + i, K - i), v1 = load_bf16(w + j * K + i + 32, K - i - 32);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        a0[j][g] = _mm512_dpbf16_ps(a0[j][g], load_bf16(x + g * K + i, K - i), v0);
        a1[j][g] = _mm512_dpbf16_ps(a1[j][g], load_bf16(x + g * K + i + 32, K - i - 32), v1);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < R; ++j)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) y[g * N + j] = c10::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(a0[j][g], a1[j][g])));
}

// Weight rows [begin, end) by every row of x, with the dot-product kernels above
void rows_dots(const c10::BFloat16* w, const c10::BFloat16* x, c10::BFloat16* y, int64_t M, int64_t N, int64_t K,
               int64_t begin, int64_t end) {
  int64_t r = begin;
  if (M <= 2) {  // few rows of x: four weight rows at a time
    for (; r + 4 <= end; r += 4) {
      if (M == 2) dots_bf16<4, 2>(w + r * K, x, K, y + r, N);
      else dots_bf16<4, 1>(w + r * K, x, K, y + r, N);
    }
  }
  for (; r < end; ++r) {
    const c10::BFloat16* row = w + r * K;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) dots_bf16<1, 8>(row, x + m * K, K, y + m * N + r, N);
    if (M - m >= 4) dots_bf16<1, 4>(row, x + m * K, K, y + m * N + r, N), m += 4;
    if (M - m >= 2) dots_bf16<1, 2>(row, x + m * K, K, y + m * N + r, N), m += 2;
    if (M - m >= 1) dots_bf16<1, 1>(row, x + m * K, K, y + m * N + r, N);
  }
}

#if defined(K3_AMX)
// On CPUs with AMX: the weight as it is stored is a tile's A operand (16 rows, 32 values a row, K apart), x in pairs
// its B operand ([16 pairs][M pairs]); each row's sums stay in a C tile [16 rows][M] across the whole of K and are
// rounded once as they are stored. Tiles take any M up to 16 at the memory's rate, where the dot-product kernels
// slow down with M (each weight vector's products go through the vector unit once per row of x). Two 16-row blocks
// run at a time (two loads of the weight in flight); either way a weight row's sums are the same instructions in the
// same order, so a row of x gets the same bits whatever rows come with it. Rows past the last 16 take the dots.
constexpr int64_t TILE_K = 32;  // bf16 values a tile row holds

// x [M][K] as K / 32 B tiles: tile k, row j, column m holds (x_m[32 k + 2 j], x_m[32 k + 2 j + 1])
std::vector<uint32_t> x_pairs(const c10::BFloat16* x, int64_t M, int64_t K) {
  std::vector<uint32_t> out(M * K / 2);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
  for (int64_t k = 0; k < K / TILE_K; ++k)
    for (int64_t j = 0; j < k3::TILE_ROWS; ++j)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t i = m * K + k * TILE_K + 2 * j;
        out[(k * k3::TILE_ROWS + j) * M + m] = bits[i] | static_cast<uint32_t>(bits[i + 1]) << 16;
      }
  return out;
}

// B blocks of 16 weight rows from w (B = 1 or 2; tiles 0-1: C, 2-3: A, 4: B) -> sums [16 B][M] fp32
template <int B>
inline void tile_rows(const c10::BFloat16* w, int64_t K, const uint32_t* xp, int64_t M, float* sums) {
  _tile_zero(0);
  if constexpr (B == 2) _tile_zero(1);
  for (int64_t k = 0; k < K / TILE_K; ++k) {
    _tile_loadd(4, xp + k * k3::TILE_ROWS * M, M * 4);
    _tile_loadd(2, w + k * TILE_K, K * 2);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (B == 2) {
      _tile_loadd(3, w + k3::TILE_ROWS * K + k * TILE_K, K * 2);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, sums, M * 4);
  if constexpr (B == 2) _tile_stored(1, sums + k3::TILE_ROWS * M, M * 4);
}

// sums [rows][M] (a C tile's layout) -> y[m * N + r] for r < rows (a multiple of 16), rounded to bf16: each 16 rows
// of column m gathered into a vector and rounded as c10::BFloat16 rounds (to nearest, ties to even)
inline void store_rows(const float* sums, int64_t rows, int64_t M, c10::BFloat16* y, int64_t N) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(M)));
  for (int64_t r = 0; r < rows; r += k3::TILE_ROWS)
    for (int64_t m = 0; m < M; ++m) {
      const __m512 v = _mm512_i32gather_ps(column, sums + r * M + m, 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + r), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

void rows_tiles(const c10::BFloat16* w, const c10::BFloat16* x, c10::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  const std::vector<uint32_t> xp = x_pairs(x, M, K);
  const int64_t blocks = N / k3::TILE_ROWS;
  at::parallel_for(0, blocks, GRAIN / k3::TILE_ROWS, [&](int64_t begin, int64_t end) {
    const uint16_t colsb[5] = {static_cast<uint16_t>(M * 4), static_cast<uint16_t>(M * 4), 64, 64,
                               static_cast<uint16_t>(M * 4)};
    const uint8_t rows[5] = {16, 16, 16, 16, 16};
    k3::configure_tiles(5, rows, colsb);
    float sums[2 * k3::TILE_ROWS * MAX_ROWS];
    for (int64_t b = begin; b < end;) {
      const int64_t n = end - b >= 2 ? 2 : 1, r0 = b * k3::TILE_ROWS;
      if (n == 2) tile_rows<2>(w + r0 * K, K, xp.data(), M, sums);
      else tile_rows<1>(w + r0 * K, K, xp.data(), M, sums);
      store_rows(sums, n * k3::TILE_ROWS, M, y + r0, N);
      b += n;
    }
    _tile_release();
  });
  if (blocks * k3::TILE_ROWS < N) rows_dots(w, x, y, M, N, K, blocks * k3::TILE_ROWS, N);
}
#endif

void rows_bf16(const c10::BFloat16* w, const c10::BFloat16* x, c10::BFloat16* y, int64_t M, int64_t N, int64_t K) {
#if defined(K3_AMX)
  if (K % TILE_K == 0 && k3::amx_permitted()) return rows_tiles(w, x, y, M, N, K);
#endif
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) { rows_dots(w, x, y, M, N, K, begin, end); });
}
#endif

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "linear_rows: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "linear_rows: at most ", MAX_ROWS, " rows");
  TORCH_CHECK(w.is_contiguous(), "linear_rows: a contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16) {
    auto xc = x.contiguous();
    auto y = at::empty({M, N}, x.options());  // each fp32 sum rounded to bf16 as it is stored, as .to() rounds it
    rows_bf16(w.data_ptr<c10::BFloat16>(), xc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), M, N, K);
    return y;
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (w.scalar_type() == at::kBFloat16) {
    rows(w.data_ptr<c10::BFloat16>(), xp, yp, M, N, K);
  } else if (w.scalar_type() == at::kHalf) {
    rows(w.data_ptr<c10::Half>(), xp, yp, M, N, K);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "linear_rows: a bf16, fp16 or fp32 weight");
    rows(w.data_ptr<float>(), xp, yp, M, N, K);
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3dist, m) { m.def("linear_rows(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(k3dist, CPU, m) { m.impl("linear_rows", &linear_rows); }
