// 4-bit weights × 8-bit activations for x86 with AVX2, and AVX-512 VNNI where the CPU has it
// (docs/engine.md, "Quantised weights").
//
// y[r, n] = (a_r / 127) · Σ_g (s[n, g] · Σ_{k ∈ g} u[n, k] · q[r, k] + m[n, g] · Σ_{k ∈ g} q[r, k])
//   u: unsigned 4-bit weights (0..15) in groups of G inputs, w = u·s + m (asymmetric: a group's
//      minimum and step, as llama.cpp's Q4_1; float16);
//   q: the row's activations as int8 (q = round(127 x / a), a = max |x| of the row).
// vpmaddubsw takes u (unsigned) times q (signed) in pairs; the Σ_g q terms come in precomputed
// per row and group (`qsum`, float32: exact, |Σ q| ≤ 128 · 127).
//
// Layout: output channels in tiles of 16, two vectors of 8 channels, one int32 lane a channel, so
// no sum crosses lanes. For each 8 inputs k..k+7 a vector is 32 bytes: byte 4c + i holds channel
// c's input k + i (low nibble) and k + 4 + i (high nibble). A row's 4 activations k..k+3,
// broadcast, meet both vectors' 8 channels. Steps and minima: [tiles, groups, 2, 16] float16.
// Every row is summed in one fixed order whatever the number of rows, so a row's output never
// depends on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

namespace {

constexpr int kVectors = 2;            // 8-channel vectors a tile
constexpr int kTile = 8 * kVectors;    // output channels a tile
constexpr int64_t kBlockBytes = 65536; // weights a block of tiles: they stay in L2 while each pass of rows reads them
// How far ahead of its reads a pass asks for weights (_mm_prefetch, one 64-byte line a step): with
// several rows' arithmetic on each line the hardware's prefetcher alone let the reads stall
// (Gemma-3-270M's linears at 5 rows: 1.6× one row's time without, ~1.1× with; docs/engine.md).
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch(const void* line) {
  _mm_prefetch(static_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
}

// Stores the first `valid` (≤ 8) lanes of `out` at `y`: the last tile may hold fewer channels.
inline void store_lanes(float* y, __m256 out, int64_t valid) {
  if (valid == 8) {
    _mm256_storeu_ps(y, out);
    return;
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, out);
  std::memcpy(y, lanes, valid * sizeof(float));
}

// R rows against tiles [t0, t1). Within each 8 inputs the two vectors go one after the other, so
// the live registers are 2·R int16 sums, one vector's two nibble halves and two broadcasts: no sum
// is spilled to the stack, where each step would wait on its store (the intrinsics' version kept
// 5 of 8 there: the compiler shared the broadcasts between the vectors).
template <int R>
void tiles(const int8_t* q, const float* qsum, const float* row_scale, const uint8_t* packed, const uint16_t* scales,
           float* y, int64_t K, int64_t N, int64_t G, int64_t t0, int64_t t1) {
  constexpr int C = kVectors;
  const int64_t groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = packed + t * kTile * (K / 2);
    const uint16_t* st = scales + t * groups * 2 * kTile;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i dot[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dot[r][c] = _mm256_setzero_si256();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        // A pair of products is at most 2·15·127 = 3810 in magnitude, so 32 inputs (8 pairs a
        // lane) add up in int16 (≤ 30,480) before widening to int32.
        __m256i sums[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sums[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int64_t j = k; j < k + 32; j += 8) {
          prefetch(wt + j * 4 * C);
          for (int c = 0; c < C; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + j * 4 * C + 32 * c));
            const __m256i low = _mm256_and_si256(bytes, mask);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            for (int r = 0; r < R; ++r) {
              __m256i first, second;
              asm("vpbroadcastd (%[q],%[j]), %[first]\n\t"
                  "vpbroadcastd 4(%[q],%[j]), %[second]\n\t"
                  "vpmaddubsw %[first], %[low], %[first]\n\t"
                  "vpmaddubsw %[second], %[high], %[second]\n\t"
                  "vpaddw %[first], %[sum], %[sum]\n\t"
                  "vpaddw %[second], %[sum], %[sum]"
                  : [sum] "+x"(sums[r][c]), [first] "=&x"(first), [second] "=&x"(second)
                  : [low] "x"(low), [high] "x"(high), [q] "r"(q + r * K), [j] "r"(j));
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(sums[r][c], ones));
      }
      for (int c = 0; c < C; ++c) {
        const uint16_t* sg = st + g * 2 * kTile + 8 * c;
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + kTile)));
        for (int r = 0; r < R; ++r) {
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][c]), s, acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(qsum[r * groups + g]), m, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        const int64_t n = t * kTile + 8 * c, valid = std::min<int64_t>(8, N - n);
        if (valid <= 0) break;
        store_lanes(y + r * N + n, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(row_scale[r])), valid);
      }
    }
  }
}

// The same tiles with AVX-512 VNNI, where the CPU has it: a tile's 16 channels are one 512-bit
// vector (the two 8-channel vectors' bytes lie side by side), and vpdpbusd adds four u·q products
// into each int32 lane at once, with no int16 stage. Each group's int32 sum is exact either way and
// the float steps are the same, so both paths give the same bits.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tiles_vnni(const int8_t* q, const float* qsum, const float* row_scale, const uint8_t* packed, const uint16_t* scales,
                float* y, int64_t K, int64_t N, int64_t G, int64_t t0, int64_t t1) {
  const int64_t groups = K / G;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = packed + t * kTile * (K / 2);
    const uint16_t* st = scales + t * groups * 2 * kTile;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t j = g * G; j < (g + 1) * G; j += 8) {
        prefetch(wt + j * 4 * kVectors);
        const __m512i bytes = _mm512_loadu_si512(wt + j * 4 * kVectors);
        const __m512i low = _mm512_and_si512(bytes, mask);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), mask);
        for (int r = 0; r < R; ++r) {
          int32_t first, second;
          std::memcpy(&first, q + r * K + j, 4);
          std::memcpy(&second, q + r * K + j + 4, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], low, _mm512_set1_epi32(first));
          dot[r] = _mm512_dpbusd_epi32(dot[r], high, _mm512_set1_epi32(second));
        }
      }
      const uint16_t* sg = st + g * 2 * kTile;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kTile)));
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qsum[r * groups + g]), m, acc[r]);
      }
    }
    const int64_t n = t * kTile, valid = std::min<int64_t>(kTile, N - n);
    const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + r * N + n, lanes, _mm512_mul_ps(acc[r], _mm512_set1_ps(row_scale[r])));
  }
}

// w8a8 on AMX, where the CPU has it: tiles of 16 rows × 64 bytes in registers of its own. tdpbusd
// adds each four byte products into an int32 as vpdpbusd does, so each sum is the same exact
// integer, and the float steps after it are VNNI's: the same bits. One weight tile serves 16 rows
// in one instruction where VNNI takes one a row, so several positions or sessions' rows read the
// weights at about one row's cost (docs/engine.md). w4a8 stays on VNNI: its sums leave the tiles
// every 32 inputs for their group's float steps, and tried that way it was slower than VNNI up to
// 40 rows and about even at 48.
constexpr int kTileRows = 16;
constexpr int kRowTiles = 3;                     // row tiles a pass: sums in tmm0-2, activations in tmm3-5, weights tmm6
constexpr int kAmxRows = kTileRows * kRowTiles;  // rows a pass

// ldtilecfg's 64 bytes (Intel SDM, "Tile configuration"): palette 1; bytes a row and rows of each tile.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A pass's tiles: P row tiles of `rows` rows in all, each with its activations (64 bytes a row);
// the weights' tile, 16 groups of 4 inputs × 16 channels.
template <int P>
__attribute__((target("amx-tile,amx-int8"))) void load_tiles(int64_t rows) {
  TileConfig config;
  for (int p = 0; p < P; ++p) {
    const auto r = static_cast<uint8_t>(std::min<int64_t>(kTileRows, rows - p * kTileRows));
    config.rows[p] = config.rows[kRowTiles + p] = r;
    config.colsb[p] = config.colsb[kRowTiles + p] = 64;
  }
  config.rows[2 * kRowTiles] = 16;
  config.colsb[2 * kRowTiles] = 64;
  _tile_loadconfig(&config);
}

// The sums of row tiles 0..P-1 stored as [P][16][16] int32 (a tile's number is part of its instruction).
template <int P>
__attribute__((target("amx-tile,amx-int8"))) inline void store_sums(int32_t* sums) {
  _tile_stored(0, sums, 64);
  if constexpr (P > 1) _tile_stored(1, sums + kTileRows * 16, 64);
  if constexpr (P > 2) _tile_stored(2, sums + 2 * kTileRows * 16, 64);
}

// P row tiles (`rows` ≤ 16·P rows of qx = q + 128, unsigned) against weight tiles [t0, t1); K a
// multiple of 64. The packed layout already lies as AMX's weight tiles: 16 groups of 4 inputs × 16 channels.
template <int P>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
void tiles8_amx(const uint8_t* qx, int64_t rows, const float* row_scale, const int8_t* packed, const float* scales,
                const int32_t* colsum128, float* y, int64_t K, int64_t N, int64_t t0, int64_t t1) {
  load_tiles<P>(rows);
  alignas(64) int32_t sums[P][kTileRows][16];
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* wt = packed + t * kTile * K;
    _tile_zero(0);
    if constexpr (P > 1) _tile_zero(1);
    if constexpr (P > 2) _tile_zero(2);
    for (int64_t k = 0; k < K; k += 64) {
      for (int line = 0; line < 16; ++line) prefetch(wt + k * kTile + 64 * line);
      _tile_loadd(6, wt + k * kTile, 64);
      _tile_loadd(3, qx + k, K);
      _tile_dpbusd(0, 3, 6);
      if constexpr (P > 1) {
        _tile_loadd(4, qx + kTileRows * K + k, K);
        _tile_dpbusd(1, 4, 6);
      }
      if constexpr (P > 2) {
        _tile_loadd(5, qx + 2 * kTileRows * K + k, K);
        _tile_dpbusd(2, 5, 6);
      }
    }
    store_sums<P>(&sums[0][0][0]);
    const int64_t n = t * kTile, valid = std::min<int64_t>(kTile, N - n);
    const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(lanes, scales + n);
    const __m512i correction = _mm512_maskz_loadu_epi32(lanes, colsum128 + n);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i dot = _mm512_load_si512(sums[r / kTileRows][r % kTileRows]);
      const __m512 total = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, correction));
      _mm512_mask_storeu_ps(y + r * N + n, lanes, _mm512_mul_ps(_mm512_mul_ps(total, s), _mm512_set1_ps(row_scale[r])));
    }
  }
  _tile_release();
}

// tiles_vnni<R> for R = 1..8 rows: a pass of any row count up to 8 in one read of the weights.
using Pass = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*, float*, int64_t,
                      int64_t, int64_t, int64_t, int64_t);
constexpr Pass kVnniPasses[9] = {nullptr, tiles_vnni<1>, tiles_vnni<2>, tiles_vnni<3>, tiles_vnni<4>,
                                 tiles_vnni<5>, tiles_vnni<6>, tiles_vnni<7>, tiles_vnni<8>};

// 8-bit weights × 8-bit activations (`mixed` mode's layers): y[r, n] = (a_r / 127) · s[n] · Σ_k w[n, k] · q[r, k],
// w int8 with one scale a channel. Layout: tiles of 16 channels; for each 4 inputs k..k+3 a tile is
// 64 bytes, byte 4c + i holding channel c's input k + i. With VNNI, vpdpbusd takes the activations
// unsigned (q + 128) and the sums lose 128 · Σ_k w[n, k] (`colsum128`); on AVX2, vpmaddubsw takes
// |w| and q with w's sign (|products| ≤ 2 · 127 · 127 in int16, no saturation). Both sums are exact.
template <int R>
void tiles8(const int8_t* q, const float* row_scale, const int8_t* packed, const float* scales, float* y, int64_t K,
            int64_t N, int64_t t0, int64_t t1) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* wt = packed + t * kTile * K;
    __m256i dot[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVectors; ++c) dot[r][c] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 4) {
      prefetch(wt + k * kTile);
      for (int c = 0; c < kVectors; ++c) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + k * kTile + 32 * c));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          int32_t word;
          std::memcpy(&word, q + r * K + k, 4);
          const __m256i signed_q = _mm256_sign_epi8(_mm256_set1_epi32(word), w);
          dot[r][c] = _mm256_add_epi32(dot[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones));
        }
      }
    }
    for (int c = 0; c < kVectors; ++c) {
      const int64_t n = t * kTile + 8 * c, valid = std::min<int64_t>(8, N - n);
      if (valid <= 0) break;
      const __m256 s = _mm256_loadu_ps(scales + n);
      for (int r = 0; r < R; ++r)
        store_lanes(y + r * N + n, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][c]), s), _mm256_set1_ps(row_scale[r])),
                    valid);
    }
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tiles8_vnni(const int8_t* q, const float* row_scale, const int8_t* packed, const float* scales, const int32_t* colsum128,
                 float* y, int64_t K, int64_t N, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* wt = packed + t * kTile * K;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 4) {
      prefetch(wt + k * kTile);
      const __m512i w = _mm512_loadu_si512(wt + k * kTile);
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, q + r * K + k, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(word ^ static_cast<int32_t>(0x80808080u)), w);
      }
    }
    const int64_t n = t * kTile, valid = std::min<int64_t>(kTile, N - n);
    const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(lanes, scales + n);
    const __m512i correction = _mm512_maskz_loadu_epi32(lanes, colsum128 + n);
    for (int r = 0; r < R; ++r) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], correction));
      _mm512_mask_storeu_ps(y + r * N + n, lanes, _mm512_mul_ps(_mm512_mul_ps(sums, s), _mm512_set1_ps(row_scale[r])));
    }
  }
}

using Pass8 = void (*)(const int8_t*, const float*, const int8_t*, const float*, const int32_t*, float*, int64_t, int64_t,
                       int64_t, int64_t);
constexpr Pass8 kVnniPasses8[9] = {nullptr, tiles8_vnni<1>, tiles8_vnni<2>, tiles8_vnni<3>, tiles8_vnni<4>,
                                   tiles8_vnni<5>, tiles8_vnni<6>, tiles8_vnni<7>, tiles8_vnni<8>};

// Which path runs: VNNI where the CPU (and the OS) offer it, unless turned off (`use_vnni`).
bool g_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vnni");
const bool kHasVnni = g_vnni;

// AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24 and 25), and the tiles' register state granted
// by Linux, which hands it to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM, 5.16+).
bool amx_offered() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}
const bool kHasAmx = kHasVnni && amx_offered();
bool g_amx = kHasAmx;
// Products of fewer rows stay on VNNI: one row reads its weights as fast there, and a tile of
// mostly empty rows buys nothing (`use_amx` sets it; both paths give the same bits).
int64_t g_amx_rows = 4;
bool amx_on() { return g_amx && g_vnni; }

// Every row of a product over its weight tiles, `block` tiles a task (their weights stay in cache
// while each pass of rows reads them): VNNI passes of up to 8 rows, `vnni(m, rows, t0, t1)`; else
// AVX2 passes of 4, 2 and 1, `avx2(std::integral_constant<int, R>, m, t0, t1)`.
template <class Vnni, class Avx2>
void row_passes(int64_t M, int64_t T, int64_t block, const Vnni& vnni, const Avx2& avx2) {
  at::parallel_for(0, T, block, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += block) {
      const int64_t t1 = std::min(end, t0 + block);
      int64_t m = 0;
      if (g_vnni) {
        // Passes of 8 rows (8 sums and 8 accumulators of the 32 registers), then one of the rest.
        for (; m < M; m += 8) vnni(m, std::min<int64_t>(8, M - m), t0, t1);
        continue;
      }
      for (; m + 4 <= M; m += 4) avx2(std::integral_constant<int, 4>(), m, t0, t1);
      for (; m + 2 <= M; m += 2) avx2(std::integral_constant<int, 2>(), m, t0, t1);
      for (; m < M; ++m) avx2(std::integral_constant<int, 1>(), m, t0, t1);
    }
  });
}

// w8a8 on AMX (`tiles8_amx`): passes of up to 48 rows over each block of `block` weight tiles.
void amx_passes(const uint8_t* qx, const float* rs, const int8_t* wp, const float* sp, const int32_t* cp, float* yp,
                int64_t M, int64_t K, int64_t N, int64_t T, int64_t block) {
  at::parallel_for(0, T, block, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += block) {
      const int64_t t1 = std::min(end, t0 + block);
      for (int64_t m = 0; m < M; m += kAmxRows) {
        const int64_t rows = std::min<int64_t>(kAmxRows, M - m);
        const auto pass = rows > 2 * kTileRows ? tiles8_amx<3> : rows > kTileRows ? tiles8_amx<2> : tiles8_amx<1>;
        pass(qx + m * K, rows, rs + m, wp, sp, cp, yp + m * N, K, N, t0, t1);
      }
    }
  });
}

torch::Tensor w4a8_linear(const torch::Tensor& q, const torch::Tensor& qsum, const torch::Tensor& row_scale,
                          const torch::Tensor& packed, const torch::Tensor& scales, int64_t group, int64_t out_features) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous int8 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2,
              "packed: contiguous uint8 [tiles, 16 · in / 2]");
  const int64_t M = q.size(0), K = q.size(1), N = out_features, T = packed.size(0);
  TORCH_CHECK((group == 32 || group == 64 || group == 128) && K % group == 0, "sizes: group 32, 64 or 128, dividing in");
  TORCH_CHECK(packed.size(1) == kTile * K / 2 && N > (T - 1) * kTile && N <= T * kTile, "packed: [ceil(out / 16), 8 · in]");
  TORCH_CHECK(qsum.dtype() == torch::kFloat32 && qsum.numel() == M * (K / group), "qsum: float32 [rows, in/group]");
  TORCH_CHECK(scales.dtype() == torch::kFloat16 && scales.numel() == T * 2 * kTile * (K / group),
              "scales: float16 [tiles, groups, 2, 16]");
  TORCH_CHECK(qsum.is_contiguous() && row_scale.is_contiguous() && scales.is_contiguous(), "contiguous inputs");
  auto y = torch::empty({M, N}, q.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* qs = qsum.data_ptr<float>();
  const float* rs = row_scale.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t groups = K / group;
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (kTile * K / 2));
  row_passes(
      M, T, block,
      [&](int64_t m, int64_t rows, int64_t t0, int64_t t1) {
        kVnniPasses[rows](qp + m * K, qs + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, t0, t1);
      },
      [&](auto rows, int64_t m, int64_t t0, int64_t t1) {
        tiles<decltype(rows)::value>(qp + m * K, qs + m * groups, rs + m, wp, sp, yp + m * N, K, N, group, t0, t1);
      });
  return y;
}

torch::Tensor w8a8_linear(const torch::Tensor& q, const torch::Tensor& row_scale, const torch::Tensor& packed,
                          const torch::Tensor& scales, const torch::Tensor& colsum128, int64_t out_features) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q: contiguous int8 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kInt8 && packed.is_contiguous() && packed.dim() == 2,
              "packed: contiguous int8 [tiles, 16 · in]");
  const int64_t M = q.size(0), K = q.size(1), N = out_features, T = packed.size(0);
  TORCH_CHECK(K % 4 == 0 && packed.size(1) == kTile * K && N > (T - 1) * kTile && N <= T * kTile, "packed: [ceil(out / 16), 16 · in]");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.numel() == T * kTile && scales.is_contiguous(), "scales: float32 [tiles · 16]");
  TORCH_CHECK(colsum128.dtype() == torch::kInt32 && colsum128.numel() == T * kTile && colsum128.is_contiguous(),
              "colsum128: int32 [tiles · 16]");
  TORCH_CHECK(row_scale.is_contiguous(), "contiguous inputs");
  auto y = torch::empty({M, N}, q.options().dtype(torch::kFloat32));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* rs = row_scale.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int32_t* cp = colsum128.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (kTile * K));
  if (amx_on() && M >= g_amx_rows && K % 64 == 0) {
    // AMX takes the activations unsigned (q + 128), as VNNI does, but from memory: one copy a call.
    const torch::Tensor shifted = torch::bitwise_xor(q, -128).view(torch::kUInt8);
    amx_passes(shifted.data_ptr<uint8_t>(), rs, wp, sp, cp, yp, M, K, N, T, block);
    return y;
  }
  row_passes(
      M, T, block,
      [&](int64_t m, int64_t rows, int64_t t0, int64_t t1) {
        kVnniPasses8[rows](qp + m * K, rs + m, wp, sp, cp, yp + m * N, K, N, t0, t1);
      },
      [&](auto rows, int64_t m, int64_t t0, int64_t t1) {
        tiles8<decltype(rows)::value>(qp + m * K, rs + m, wp, sp, yp + m * N, K, N, t0, t1);
      });
  return y;
}

}  // namespace

// The instruction set the kernel runs: "avx512vnni" or "avx2".
std::string isa() { return g_vnni ? "avx512vnni" : "avx2"; }

// Whether products of `from_rows` rows or more run on AMX, with VNNI on; turns it off, or back on
// where the CPU and the OS offer it.
bool use_amx(bool on, int64_t from_rows) {
  g_amx = on && kHasAmx;
  g_amx_rows = std::max<int64_t>(1, from_rows);
  return amx_on();
}

// Turns the VNNI path off (or back on, where the CPU has it); returns the instruction set now used.
std::string use_vnni(bool on) {
  g_vnni = on && kHasVnni;
  return isa();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // This library's own copy of torch's once-a-thread set-up of the thread count (an inline
  // function's thread_local): `compute_on` runs it first, so that it cannot undo the count later.
  m.def("init_threads", &at::internal::lazy_init_num_threads);
  m.def("isa", &isa);
  m.def("use_vnni", &use_vnni);
  m.def("use_amx", &use_amx);
  m.def("amx", &amx_on);
  m.def("amx_rows", [] { return g_amx_rows; });
}

// The kernels, as torch operators (`torch.ops.specwire.*`), so that a compiled graph calls them
// through the dispatcher with no Python in between (as a Python custom op, ~6 µs more a call
// here; a decode step makes one a linear); their shapes for the compiler are in quantize.py.
TORCH_LIBRARY_FRAGMENT(specwire, m) {
  m.def("w4a8_linear(Tensor q, Tensor qsum, Tensor row_scale, Tensor packed, Tensor scales, int group, "
        "int out_features) -> Tensor");
  m.def("w8a8_linear(Tensor q, Tensor row_scale, Tensor packed, Tensor scales, Tensor colsum128, "
        "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specwire, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
}
