// 4-bit weights × 8-bit activations for x86 with AVX2 (docs/engine.md, "Quantised weights").
//
// y[r, n] = (a_r / 127) · Σ_g s[n, g] · Σ_{k ∈ g} (u[n, k] − 8) · q[r, k]
//   u: unsigned 4-bit weights (0..15), groups of G inputs sharing the scale s[n, g];
//   q: the row's activations as int8 (q = round(127 x / a), a = max |x| of the row).
// Σ (u − 8)·q = Σ u·q − 8·Σ q: vpmaddubsw takes u (unsigned) times q (signed) in pairs, and the
// 8·Σ_g q terms come in precomputed per row and group (`qsum8`, int32), subtracted in int32.
// Packing: groups of 64 or 128 inputs take 32 bytes per 64 inputs, byte j holding input j (low
// nibble) and j + 32; groups of 32 take 16 bytes, byte j holding input j and j + 16. One load and
// two masks give 64 weights (32 in groups of 32).
// Every row is summed in one fixed order whatever the number of rows, so a row's output never
// depends on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

namespace {

inline __m256i low_nibbles(__m256i bytes) { return _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i bytes) { return low_nibbles(_mm256_srli_epi16(bytes, 4)); }

inline __m256i unpack_32(const uint8_t* packed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
}

inline __m256i load(const int8_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows against output channels [n0, n1): each block of weights is unpacked once for the R rows.
// offsets[r · groups + g]: 8·Σ_g q of row r in the first lane.
template <int R>
void rows(const int8_t* q, const __m256i* offsets, const float* row_scale, const uint8_t* packed, const float* scales,
          float* y, int64_t K, int64_t N, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = packed + n * (K / 2);
    const float* sn = scales + n * groups;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      // A pair of products is at most 2·15·127 = 3810 in magnitude, so a group's ≤ 4 blocks
      // add up in int16 (≤ 15,240) and widen to int32 once a group.
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      if (G == 32) {
        const int64_t k = g * 32;
        const __m256i w = unpack_32(wn + k / 2);
        for (int r = 0; r < R; ++r) sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(w, load(q + r * K + k)));
      } else {
        for (int64_t k = g * G; k < (g + 1) * G; k += 64) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k / 2));
          const __m256i w0 = low_nibbles(bytes), w1 = high_nibbles(bytes);
          for (int r = 0; r < R; ++r) {
            const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(w0, load(q + r * K + k)),
                                                  _mm256_maddubs_epi16(w1, load(q + r * K + k + 32)));
            sums[r] = _mm256_add_epi16(sums[r], both);
          }
        }
      }
      const __m256 s = _mm256_set1_ps(sn[g]);
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(sums[r], ones), offsets[r * groups + g]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = horizontal_sum(acc[r]) * row_scale[r];
  }
}

torch::Tensor w4a8_linear(const torch::Tensor& q, const torch::Tensor& qsum8, const torch::Tensor& row_scale,
                          const torch::Tensor& packed, const torch::Tensor& scales, int64_t group) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous int8 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed: contiguous uint8 [out, in/2]");
  const int64_t M = q.size(0), K = q.size(1), N = packed.size(0);
  TORCH_CHECK((group == 32 || group == 64 || group == 128) && K % group == 0 && packed.size(1) * 2 == K,
              "sizes: group 32, 64 or 128, dividing in");
  TORCH_CHECK(qsum8.dtype() == torch::kInt32, "qsum8: int32 [rows, in/group]");
  TORCH_CHECK(qsum8.is_contiguous() && row_scale.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  auto y = torch::empty({M, N}, q.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const int32_t* qs = qsum8.data_ptr<int32_t>();
  const float* rs = row_scale.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / group;
  std::vector<__m256i> offsets(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) offsets[i] = _mm256_setr_epi32(qs[i], 0, 0, 0, 0, 0, 0, 0);
  const __m256i* op = offsets.data();
  // 128 channels a task: their weights (≤ 128 · K / 2 bytes) stay in L2 between row blocks.
  at::parallel_for(0, N, 128, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows<4>(qp + m * K, op + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, n0, n1);
    for (; m + 2 <= M; m += 2) rows<2>(qp + m * K, op + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, n0, n1);
    for (; m < M; ++m) rows<1>(qp + m * K, op + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, n0, n1);
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("w4a8_linear", &w4a8_linear); }
