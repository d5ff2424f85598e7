// Attention for one new token of one row and head at a time, over that row's own keys, in one
// fixed order (docs/engine.md, "Row-invariant attention").
//
// out[b, h, t] = Σ_j e_j · v[b, h / G, j] / Σ_j e_j,  e_j = exp(s_j − max s),
// s_j = scale · q[b, h, t] · k[b, h / G, j], over the slots j < extents[b, 1] that mask[b, 0, t, j]
// allows (G query heads share a key/value head); zeros for t ≥ extents[b, 0], the padding.
// Nothing in a token's sums depends on the batch, the keys padded past its row or the thread
// that computes it, so a row gets the same bits alone and in any batch, and each token of a
// verification the bits of a decode step at its position.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int HEADS = 4;  // query heads of one key/value head computed together: each key read once

// scores[g · slots + j] = scale · q_g · k_j for the keys the mask allows, −∞ for the others;
// best[g] = their maximum.
template <int N>
void score(const float* const* q, const float* k, int64_t k_stride, const bool* allowed, int64_t mask_stride,
           int64_t slots, int64_t D, float scale, float* scores, float* best) {
  const float low = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < N; ++g) best[g] = low;
  for (int64_t j = 0; j < slots; ++j) {
    if (!allowed[j * mask_stride]) {
      for (int g = 0; g < N; ++g) scores[g * slots + j] = low;
      continue;
    }
    const float* kj = k + j * k_stride;
    __m256 even[N], odd[N];
    for (int g = 0; g < N; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const __m256 k0 = _mm256_loadu_ps(kj + d), k1 = _mm256_loadu_ps(kj + d + 8);
      for (int g = 0; g < N; ++g) {
        even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d + 8), k1, odd[g]);
      }
    }
    for (int g = 0; g < N; ++g) {
      float sum = horizontal_sum(_mm256_add_ps(even[g], odd[g]));
      for (int64_t i = d; i < D; ++i) sum += q[g][i] * kj[i];
      scores[g * slots + j] = sum * scale;
      best[g] = std::max(best[g], scores[g * slots + j]);
    }
  }
}

constexpr int64_t KEY_BLOCK = 32;  // keys mixed a pass: their values (32 · D floats) stay in L1/L2

// out_g = Σ_j w[g · slots + j] · v_j / total_g over the allowed keys, KEY_BLOCK keys at a time
// (each block's sum added to out_g in block order, a fixed order for a given row).
template <int N>
void mix(const float* w, const float* total, const float* v, int64_t v_stride, const bool* allowed,
         int64_t mask_stride, int64_t slots, int64_t D, float* const* out) {
  for (int64_t first = 0; first < slots; first += KEY_BLOCK) {
    const int64_t last = std::min(first + KEY_BLOCK, slots);
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      __m256 even[N], odd[N];
      for (int g = 0; g < N; ++g) even[g] = odd[g] = _mm256_setzero_ps();
      for (int64_t j = first; j < last; ++j) {
        if (!allowed[j * mask_stride]) continue;
        const __m256 v0 = _mm256_loadu_ps(v + j * v_stride + d), v1 = _mm256_loadu_ps(v + j * v_stride + d + 8);
        for (int g = 0; g < N; ++g) {
          const __m256 weight = _mm256_broadcast_ss(w + g * slots + j);
          even[g] = _mm256_fmadd_ps(weight, v0, even[g]);
          odd[g] = _mm256_fmadd_ps(weight, v1, odd[g]);
        }
      }
      for (int g = 0; g < N; ++g) {
        _mm256_storeu_ps(out[g] + d, _mm256_add_ps(_mm256_loadu_ps(out[g] + d), even[g]));
        _mm256_storeu_ps(out[g] + d + 8, _mm256_add_ps(_mm256_loadu_ps(out[g] + d + 8), odd[g]));
      }
    }
    for (; d < D; ++d) {
      for (int g = 0; g < N; ++g) {
        float sum = 0.0f;
        for (int64_t j = first; j < last; ++j)
          if (allowed[j * mask_stride]) sum += w[g * slots + j] * v[j * v_stride + d];
        out[g][d] += sum;
      }
    }
  }
  for (int g = 0; g < N; ++g)
    for (int64_t d = 0; d < D; ++d) out[g][d] /= total[g];
}

// One token of one row for N query heads sharing a key/value head.
template <int N>
void attend(const float* const* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
            const bool* allowed, int64_t mask_stride, int64_t slots, int64_t D, float scale, float* scores,
            float* const* out) {
  float best[N], total[N];
  score<N>(q, k, k_stride, allowed, mask_stride, slots, D, scale, scores, best);
  if (best[0] == -std::numeric_limits<float>::infinity()) return;  // sees nothing: zeros
  for (int g = 0; g < N; ++g) {
    total[g] = 0.0f;
    for (int64_t j = 0; j < slots; ++j) {
      float& e = scores[g * slots + j];
      e = allowed[j * mask_stride] ? std::exp(e - best[g]) : 0.0f;
      total[g] += e;
    }
  }
  mix<N>(scores, total, v, v_stride, allowed, mask_stride, slots, D, out);
}

// rows (optional, [B] long): keys/values hold the cache's rows and batch row b reads rows[b], so
// gathered rows are read in place rather than copied.
torch::Tensor row_attention(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                            const torch::Tensor& mask, const torch::Tensor& extents, double scale,
                            const std::optional<torch::Tensor>& rows) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 4, "4-d inputs");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32 &&
              values.scalar_type() == torch::kFloat32, "float32 query, keys and values");
  TORCH_CHECK(query.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1, "contiguous head dimension");
  TORCH_CHECK(mask.scalar_type() == torch::kBool, "mask: bool");
  TORCH_CHECK(extents.scalar_type() == torch::kLong && extents.is_contiguous() && extents.dim() == 2, "extents: [B, 2] long");
  const int64_t B = query.size(0), H = query.size(1), T = query.size(2), D = query.size(3);
  const int64_t kv_heads = keys.size(1), L = keys.size(2);
  TORCH_CHECK(H % kv_heads == 0 && values.sizes() == keys.sizes() && keys.size(3) == D,
              "keys/values: [B, Hkv, L, D] with Hkv dividing the query heads");
  std::vector<int64_t> row_of(B);
  for (int64_t b = 0; b < B; ++b) row_of[b] = b;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == torch::kLong && rows->dim() == 1 && rows->size(0) == B, "rows: [B] long");
    const auto chosen = rows->contiguous();
    for (int64_t b = 0; b < B; ++b) {
      row_of[b] = chosen.data_ptr<int64_t>()[b];
      TORCH_CHECK(row_of[b] >= 0 && row_of[b] < keys.size(0), "rows: an index past the keys' rows");
    }
  } else {
    TORCH_CHECK(keys.size(0) == B, "keys/values: [B, Hkv, L, D]");
  }
  TORCH_CHECK(mask.size(0) == B && mask.size(2) == T && mask.size(3) == L && extents.size(0) == B, "mask: [B, 1, T, L]");
  const int64_t group = H / kv_heads;
  // The query's layout (often a transposed view), as the op's fake implementation promises the
  // compiler: code compiled around the op reads the output with those strides.
  auto out = torch::zeros_like(query);
  TORCH_CHECK(out.stride(3) == 1, "contiguous head dimension");
  const float* q = query.data_ptr<float>();
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  const bool* m = mask.data_ptr<bool>();
  const int64_t* ext = extents.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const auto qs = query.strides(), ks = keys.strides(), vs = values.strides(), ms = mask.strides(), os = out.strides();
  const auto step = static_cast<float>(scale);
  // A task: one token of one row and key/value head, its query heads HEADS at a time.
  at::parallel_for(0, B * kv_heads * T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(HEADS * L);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (kv_heads * T), kv = task / T % kv_heads, t = task % T;
      if (t >= ext[2 * b]) continue;  // padding: zeros
      const int64_t slots = std::min(ext[2 * b + 1], L);
      const float* kb = k + row_of[b] * ks[0] + kv * ks[1];
      const float* vb = v + row_of[b] * vs[0] + kv * vs[1];
      const bool* allowed = m + b * ms[0] + t * ms[2];
      for (int64_t first = kv * group; first < (kv + 1) * group; first += HEADS) {
        const float* heads_q[HEADS];
        float* heads_out[HEADS];
        const int n = static_cast<int>(std::min<int64_t>(HEADS, (kv + 1) * group - first));
        for (int g = 0; g < n; ++g) {
          heads_q[g] = q + b * qs[0] + (first + g) * qs[1] + t * qs[2];
          heads_out[g] = o + b * os[0] + (first + g) * os[1] + t * os[2];
        }
        const auto run = n == 4 ? attend<4> : n == 3 ? attend<3> : n == 2 ? attend<2> : attend<1>;
        run(heads_q, kb, ks[2], vb, vs[2], allowed, ms[3], slots, D, step, scores.data(), heads_out);
      }
    }
  });
  return out;
}

// The operator's form: the mask broadcast over the batch here, as the Python op does.
torch::Tensor row_attention_op(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& mask, const torch::Tensor& extents, double scale,
                               const std::optional<torch::Tensor>& rows) {
  return row_attention(query, keys, values, mask.expand({query.size(0), 1, query.size(2), keys.size(2)}), extents,
                       scale, rows);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init_threads", &at::internal::lazy_init_num_threads);  // as in w4a8.cpp
  m.def("row_attention", &row_attention);
}

// As a torch operator (`torch.ops.specwire.row_attention_kernel`), so that a compiled graph calls
// it through the dispatcher, with no Python between (as w4a8.cpp's); its shape for the compiler
// is in forward.py.
TORCH_LIBRARY_FRAGMENT(specwire, m) {
  m.def("row_attention_kernel(Tensor query, Tensor keys, Tensor values, Tensor mask, Tensor extents, float scale, "
        "Tensor? rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(specwire, CPU, m) {
  m.impl("row_attention_kernel", &row_attention_op);
}
