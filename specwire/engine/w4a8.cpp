// 4-bit weights × 8-bit activations for x86 with AVX2 (docs/engine.md, "Quantised weights").
//
// y[r, n] = (a_r / 127) · Σ_g s[n, g] · Σ_{k ∈ g} (u[n, k] − 8) · q[r, k]
//   u: unsigned 4-bit weights (0..15), groups of G inputs sharing the scale s[n, g];
//   q: the row's activations as int8 (q = round(127 x / a), a = max |x| of the row).
// Σ (u − 8)·q = Σ u·q − 8·Σ q: vpmaddubsw takes u (unsigned) times q (signed) in pairs, and the
// 8·Σ_g q terms come in precomputed per row and group (`qsum8`, int32), subtracted in int32.
//
// Layout: output channels in tiles of 16, two vectors of 8 channels, one int32 lane a channel, so
// no sum crosses lanes. For each 8 inputs k..k+7 a vector is 32 bytes: byte 4c + i holds channel
// c's input k + i (low nibble) and k + 4 + i (high nibble). A row's 4 activations k..k+3,
// broadcast, meet both vectors' 8 channels. Scales: [tiles, groups, 16].
// Every row is summed in one fixed order whatever the number of rows, so a row's output never
// depends on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int kVectors = 2;            // 8-channel vectors a tile
constexpr int kTile = 8 * kVectors;    // output channels a tile
constexpr int64_t kBlockBytes = 65536; // weights a block of tiles: they stay in L2 while each pass of rows reads them

inline __m256i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// R rows against tiles [t0, t1).
template <int R>
void tiles(const int8_t* q, const int32_t* qsum8, const float* row_scale, const uint8_t* packed, const float* scales,
           float* y, int64_t K, int64_t N, int64_t G, int64_t t0, int64_t t1) {
  constexpr int C = kVectors;
  const int64_t groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = packed + t * kTile * (K / 2);
    const float* st = scales + t * groups * kTile;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i dot[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dot[r][c] = _mm256_set1_epi32(-qsum8[r * groups + g]);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        // A pair of products is at most 2·15·127 = 3810 in magnitude, so 32 inputs (8 pairs a
        // lane) add up in int16 (≤ 30,480) before widening to int32.
        __m256i sums[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int64_t j = k; j < k + 32; j += 8) {
          __m256i low[C], high[C];
          for (int c = 0; c < C; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + j * 4 * C + 32 * c));
            low[c] = _mm256_and_si256(bytes, mask);
            high[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
          }
          for (int r = 0; r < R; ++r) {
            const __m256i first = broadcast4(q + r * K + j), second = broadcast4(q + r * K + j + 4);
            for (int c = 0; c < C; ++c) {
              sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(low[c], first));
              sums[r][c] = _mm256_add_epi16(sums[r][c], _mm256_maddubs_epi16(high[c], second));
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(sums[r][c], ones));
      }
      for (int c = 0; c < C; ++c) {
        const __m256 s = _mm256_loadu_ps(st + g * kTile + 8 * c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][c]), s, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        const int64_t n = t * kTile + 8 * c, valid = std::min<int64_t>(8, N - n);
        if (valid <= 0) break;
        const __m256 out = _mm256_mul_ps(acc[r][c], _mm256_set1_ps(row_scale[r]));
        if (valid == 8) {
          _mm256_storeu_ps(y + r * N + n, out);
        } else {
          float lanes[8];
          _mm256_storeu_ps(lanes, out);
          std::memcpy(y + r * N + n, lanes, valid * sizeof(float));
        }
      }
    }
  }
}

torch::Tensor w4a8_linear(const torch::Tensor& q, const torch::Tensor& qsum8, const torch::Tensor& row_scale,
                          const torch::Tensor& packed, const torch::Tensor& scales, int64_t group, int64_t out_features) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous int8 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "packed: contiguous uint8 [tiles, 16 · in / 2]");
  const int64_t M = q.size(0), K = q.size(1), N = out_features, T = packed.size(0);
  TORCH_CHECK((group == 32 || group == 64 || group == 128) && K % group == 0, "sizes: group 32, 64 or 128, dividing in");
  TORCH_CHECK(packed.size(1) == kTile * K / 2 && N > (T - 1) * kTile && N <= T * kTile, "packed: [ceil(out / 16), 8 · in]");
  TORCH_CHECK(qsum8.dtype() == torch::kInt32 && qsum8.numel() == M * (K / group), "qsum8: int32 [rows, in/group]");
  TORCH_CHECK(scales.numel() == T * kTile * (K / group), "scales: [tiles, groups, 16]");
  TORCH_CHECK(qsum8.is_contiguous() && row_scale.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  auto y = torch::empty({M, N}, q.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const int32_t* qs = qsum8.data_ptr<int32_t>();
  const float* rs = row_scale.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / group;
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (kTile * K / 2));
  at::parallel_for(0, T, block, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += block) {
      const int64_t t1 = std::min(end, t0 + block);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tiles<4>(qp + m * K, qs + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, t0, t1);
      for (; m + 2 <= M; m += 2) tiles<2>(qp + m * K, qs + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, t0, t1);
      for (; m < M; ++m) tiles<1>(qp + m * K, qs + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, t0, t1);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w4a8_linear", &w4a8_linear); }
