// lssp::block_mm: y = x W^T for a weight W in groups of 32 inputs, w = q * d + m, with q unsigned 4-bit (0..15: a
// GGUF's Q4_1 blocks) or 8-bit (0..255: a Q8_0 block's q + 128, with m = -128 d), and activations quantized to int8
// in groups of 32 (s = max|x| / 127) as llama.cpp quantizes them (Q8_1):
//   y[r, n] = sum_g d[n, g] s[r, g] sum_k q[n, k] xq[r, k]  +  m[n, g] s[r, g] sum_k xq[r, k]
// The integer dot products run on AVX512-VNNI (vpdpbusd: unsigned weights by signed int8 activations, 4 per lane),
// or on AVX2 where the CPU has no AVX-512 (vpmaddubsw and vpmaddwd: the same sums, exact).
// Each output is computed by one thread in the same order whatever the number of rows: a row's result does not
// depend on the rows beside it (a verification forward of K+1 tokens gives the one-token forward's numbers).
//
// packed (N, K * bits / 8) uint8, in blocks of 16 weight rows; within a block, 4-bit: inputs 8c..8c+7 take 64 bytes,
// byte 4i+j holding row i's q[8c+j] (low nibble) and q[8c+4+j] (high nibble); 8-bit: inputs 4c..4c+3 take 64 bytes,
// byte 4i+j holding row i's q[4c+j]. scales, mins: (N/16, K/32, 16) float16, the same blocks. x: (R, K) float32.
// K a multiple of 32, N of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#include <type_traits>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <sys/mman.h>
#include <omp.h>
#include <memory>
#include <mutex>
#include <thread>

namespace {

// The 16-lane vectors the kernel is written in: AVX-512 registers where the CPU has AVX512-VNNI, else pairs of AVX2
// registers (FMA and F16C too), the same operations lane for lane. Integer dot products are exact either way; float
// sums group alike, so a row's numbers still do not depend on the rows beside it (they differ between the two ISAs).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define LSSP_AVX512 1
using v16f = __m512;
using v16i = __m512i;
using mask16 = __mmask16;
#define v16_abs_ps _mm512_abs_ps
#define v16_add_epi32 _mm512_add_epi32
#define v16_add_ps _mm512_add_ps
#define v16_and_si512 _mm512_and_si512
#define v16_cvtepi32_ps _mm512_cvtepi32_ps
#define v16_cvtph_ps _mm512_cvtph_ps
#define v16_div_ps _mm512_div_ps
#define v16_dpbusd_epi32 _mm512_dpbusd_epi32
#define v16_fmadd_ps _mm512_fmadd_ps
#define v16_fnmadd_ps _mm512_fnmadd_ps
#define v16_loadu_ps _mm512_loadu_ps
#define v16_loadu_si512 _mm512_loadu_si512
#define v16_mask_add_ps _mm512_mask_add_ps
#define v16_mask_loadu_ps _mm512_mask_loadu_ps
#define v16_mask_storeu_ps _mm512_mask_storeu_ps
#define v16_maskz_loadu_ps _mm512_maskz_loadu_ps
#define v16_max_ps _mm512_max_ps
#define v16_min_ps _mm512_min_ps
#define v16_mul_ps _mm512_mul_ps
#define v16_reduce_add_ps _mm512_reduce_add_ps
#define v16_reduce_max_ps _mm512_reduce_max_ps
#define v16_scalef_ps _mm512_scalef_ps
#define v16_set1_epi32 _mm512_set1_epi32
#define v16_set1_epi8 _mm512_set1_epi8
#define v16_set1_ps _mm512_set1_ps
#define v16_setzero_ps _mm512_setzero_ps
#define v16_setzero_si512 _mm512_setzero_si512
#define v16_srli_epi16 _mm512_srli_epi16
#define v16_storeu_ps _mm512_storeu_ps
#define v16_sub_ps _mm512_sub_ps
#define v16_dpbusd_small_epi32 _mm512_dpbusd_epi32  // unsigned operands below 128: the same as dpbusd
#define v16_roundscale_ps _mm512_roundscale_ps
#define v16_cvtps_epi32 _mm512_cvtps_epi32  // to the nearest integer (ties to even), as std::nearbyint
#define v16_reduce_add_epi32 _mm512_reduce_add_epi32
inline void v16_store_epi8(int8_t* p, v16i a) {  // each lane's int32 (within -128..127) as a byte
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a));
}

// The sums of the 16 lanes of each of a0..a3: (sum a0, sum a1, sum a2, sum a3).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // In each 128-bit lane: [a0 e0+e2, a1 e0+e2, a0 e1+e3, a1 e1+e3], and the same for a2, a3.
  const __m512d s01 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
  const __m512d s23 = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
  // In each 128-bit lane: that lane's sums of a0, a1, a2, a3; then the four lanes added.
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(s01, s23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(s01, s23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LSSP_AVX512 0
struct v16f { __m256 lo, hi; };
struct v16i { __m256i lo, hi; };
struct mask16 { __m256i lo, hi; };  // all ones in a lane that is on

inline v16f pair(__m256 lo, __m256 hi) { return {lo, hi}; }
inline v16i ipair(__m256i lo, __m256i hi) { return {lo, hi}; }
inline v16f v16_setzero_ps() { return pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
inline v16f v16_set1_ps(float x) { return pair(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
inline v16f v16_loadu_ps(const float* p) { return pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
inline void v16_storeu_ps(float* p, v16f a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline v16f v16_maskz_loadu_ps(mask16 m, const float* p) {
  return pair(_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi));
}
inline v16f v16_mask_loadu_ps(v16f src, mask16 m, const float* p) {
  const v16f x = v16_maskz_loadu_ps(m, p);
  return pair(_mm256_blendv_ps(src.lo, x.lo, _mm256_castsi256_ps(m.lo)),
              _mm256_blendv_ps(src.hi, x.hi, _mm256_castsi256_ps(m.hi)));
}
inline void v16_mask_storeu_ps(float* p, mask16 m, v16f a) {
  _mm256_maskstore_ps(p, m.lo, a.lo);
  _mm256_maskstore_ps(p + 8, m.hi, a.hi);
}
#define LSSP_V16_BINARY(name, op) \
  inline v16f v16_##name(v16f a, v16f b) { return pair(op(a.lo, b.lo), op(a.hi, b.hi)); }
LSSP_V16_BINARY(add_ps, _mm256_add_ps)
LSSP_V16_BINARY(sub_ps, _mm256_sub_ps)
LSSP_V16_BINARY(mul_ps, _mm256_mul_ps)
LSSP_V16_BINARY(div_ps, _mm256_div_ps)
LSSP_V16_BINARY(max_ps, _mm256_max_ps)
LSSP_V16_BINARY(min_ps, _mm256_min_ps)
#undef LSSP_V16_BINARY
inline v16f v16_mask_add_ps(v16f src, mask16 m, v16f a, v16f b) {
  const v16f x = v16_add_ps(a, b);
  return pair(_mm256_blendv_ps(src.lo, x.lo, _mm256_castsi256_ps(m.lo)),
              _mm256_blendv_ps(src.hi, x.hi, _mm256_castsi256_ps(m.hi)));
}
inline v16f v16_fmadd_ps(v16f a, v16f b, v16f c) {
  return pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
inline v16f v16_fnmadd_ps(v16f a, v16f b, v16f c) {
  return pair(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
inline v16f v16_abs_ps(v16f a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return pair(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
inline float hsum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float v16_reduce_add_ps(v16f a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float v16_reduce_max_ps(v16f a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline v16f v16_roundscale_ps(v16f a, int) {  // to the nearest integer, as the kernel asks
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return pair(_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode));
}
inline __m256 scale8(__m256 p, __m256 n) {  // p * 2^n for integral n in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline v16f v16_scalef_ps(v16f p, v16f n) {
  const __m256 lowest = _mm256_set1_ps(-126.0f);  // e^-88 needs 2^-127: one step short of it, as good as zero here
  return pair(scale8(p.lo, _mm256_max_ps(n.lo, lowest)), scale8(p.hi, _mm256_max_ps(n.hi, lowest)));
}
inline v16f v16_cvtph_ps(__m256i h) {
  return pair(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
inline v16f v16_cvtepi32_ps(v16i a) { return pair(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
inline v16i v16_cvtps_epi32(v16f a) { return ipair(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); }
inline int32_t v16_reduce_add_epi32(v16i a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
inline void v16_store_epi8(int8_t* p, v16i a) {  // each lane's int32 (within -128..127) as a byte, in order
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}
inline v16i v16_setzero_si512() { return ipair(_mm256_setzero_si256(), _mm256_setzero_si256()); }
inline v16i v16_set1_epi8(char x) { return ipair(_mm256_set1_epi8(x), _mm256_set1_epi8(x)); }
inline v16i v16_set1_epi32(int32_t x) { return ipair(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
inline v16i v16_loadu_si512(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return ipair(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
}
inline v16i v16_and_si512(v16i a, v16i b) { return ipair(_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)); }
inline v16i v16_add_epi32(v16i a, v16i b) { return ipair(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); }
inline v16i v16_srli_epi16(v16i a, int n) { return ipair(_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)); }
// acc + the sums of 4 adjacent products of unsigned u and signed s bytes in each 32-bit lane (vpdpbusd), for u below
// 128, so that the pairs vpmaddubsw adds cannot saturate int16 (2 * 127 * 128 < 2^15).
inline __m256i dot4_small(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline v16i v16_dpbusd_small_epi32(v16i acc, v16i u, v16i s) {
  return ipair(dot4_small(acc.lo, u.lo, s.lo), dot4_small(acc.hi, u.hi, s.hi));
}
// The 8-bit tile's road: q - 128 as signed bytes: q - 128 as signed bytes (q XOR 0x80), then acc + the sums of 4 adjacent products of
// those signed bytes q8 (|q8| given) and s, by vpmaddubsw on |q8| and s with q8's sign: pairs of at most
// 2 * 128 * 127, below 2^15, so exact.
inline v16i v16_flip_sign_bits(v16i u) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return ipair(_mm256_xor_si256(u.lo, flip), _mm256_xor_si256(u.hi, flip));
}
inline v16i v16_abs_epi8(v16i a) { return ipair(_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)); }
inline __m256i dot4_signed(__m256i acc, __m256i magnitude, __m256i q8, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(s, q8));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline v16i v16_dot_signed(v16i acc, v16i magnitude, v16i q8, v16i s) {
  return ipair(dot4_signed(acc.lo, magnitude.lo, q8.lo, s.lo), dot4_signed(acc.hi, magnitude.hi, q8.hi, s.hi));
}

// The sums of the 16 lanes of each of a0..a3: (sum a0, sum a1, sum a2, sum a3).
inline __m128 sum4(v16f a0, v16f a1, v16f a2, v16f a3) {
  const __m256 s0 = _mm256_add_ps(a0.lo, a0.hi), s1 = _mm256_add_ps(a1.lo, a1.hi);
  const __m256 s2 = _mm256_add_ps(a2.lo, a2.hi), s3 = _mm256_add_ps(a3.lo, a3.hi);
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));  // per 128-bit lane: a0 a1 a2 a3
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#else
#error "lssp's block kernel needs AVX512-VNNI, or AVX2 with FMA and F16C"
#endif

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 8;
constexpr int64_t kRowsPerThread = 16;  // from here the per-row work beside the matmuls is split between threads
constexpr int64_t kAhead = 4096;  // bytes of weights prefetched ahead of those multiplied: on an AMD EPYC (2 cores),
                                  // a q4_1 forward 4-6% faster than at 2048 and 15-18% than with none (interleaved A/B in one process)

#ifdef LSSP_PHASES  // benchmarks/forward_phases.py's own build: the decoder's time by phase, summed over its calls
constexpr int kPhases = 11;  // norm, qkv, rope and cache, attention, o, residual and norm, gate_up, silu, down,
                             // residual, output layer; then the number of calls
double phase_seconds[kPhases + 1];
inline double phase_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
#define LSSP_LAP_START() double lap_ = phase_now(); phase_seconds[kPhases] += 1
#define LSSP_LAP_RESET() lap_ = phase_now()
#define LSSP_LAP(i) do { const double now_ = phase_now(); phase_seconds[i] += now_ - lap_; lap_ = now_; } while (0)
#define LSSP_LAP_IF(first, i) do { if (first) LSSP_LAP(i); } while (0)  // one thread's laps in a team
at::Tensor phase_times() {  // the sums since the last call (seconds; the last entry: calls), then zeros
  at::Tensor out = at::empty({kPhases + 1}, at::TensorOptions().dtype(at::kDouble));
  std::copy(phase_seconds, phase_seconds + kPhases + 1, out.data_ptr<double>());
  std::fill(phase_seconds, phase_seconds + kPhases + 1, 0.0);
  return out;
}
#else
#define LSSP_LAP_START()
#define LSSP_LAP_RESET()
#define LSSP_LAP(i)
#define LSSP_LAP_IF(first, i)
#endif

// Activations in int8 groups: xq (R, K), each group's scale s, s * sum(xq) for the minimum's term, and sum(xq).
struct Quantized {
  const int8_t* xq;
  const float* row_scales;
  const float* group_sums;
  const int32_t* group_totals;
};

// Rows r0..r1-1 of x (R, K) in int8 groups.
void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int8_t* xq, float* row_scales, float* group_sums,
                   int32_t* group_totals) {
  const int64_t G = K / kGroup;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + r * K + g * kGroup;
      const v16f a = v16_loadu_ps(v), b = v16_loadu_ps(v + 16);
      const float amax = v16_reduce_max_ps(v16_max_ps(v16_abs_ps(a), v16_abs_ps(b)));
      const float s = amax / 127.0f;
      const v16f inv = v16_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const v16i qa = v16_cvtps_epi32(v16_mul_ps(a, inv)), qb = v16_cvtps_epi32(v16_mul_ps(b, inv));
      v16_store_epi8(xq + r * K + g * kGroup, qa);
      v16_store_epi8(xq + r * K + g * kGroup + 16, qb);
      const int32_t total = v16_reduce_add_epi32(v16_add_epi32(qa, qb));
      row_scales[r * G + g] = s;
      group_sums[r * G + g] = s * static_cast<float>(total);
      group_totals[r * G + g] = total;
    }
}

// Rows r0..r0+T-1 of the output for the blocks of 16 weight rows nb0..nb1-1. Each 32-bit lane of a vector is one
// weight row: vpdpbusd adds 4 of its products to it, so no horizontal sums are needed.
template <int T, int Bits>
void tile(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const Quantized& a, float* y, int64_t r0,
          int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  constexpr int kChunks = Bits;  // 64-byte loads per group of 32 inputs of 16 rows (16 * 32 * Bits / 8 bytes)
  const v16i low = v16_set1_epi8(0x0F);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint8_t* w = packed + nb * 16 * (K * Bits / 8);
    const at::Half* d = scales + nb * 16 * G;
    const at::Half* m = mins + nb * 16 * G;
    v16f acc[T];
    for (int t = 0; t < T; ++t) acc[t] = v16_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      // Integer sums: exact in any order, so the split into accumulators (two chains where there are few rows, to
      // hide vpdpbusd's latency; one per row beyond, to keep every accumulator in a register) changes no result.
      constexpr int kSplit = T <= 2 ? 2 : 1;
      v16i dot[T][kSplit];
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < kSplit; ++j) dot[t][j] = v16_setzero_si512();
      for (int c = 0; c < kChunks; ++c) {
        const uint8_t* at = w + (g * kChunks + c) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
        const v16i raw = v16_loadu_si512(at);
        if constexpr (Bits == 4) {
          const v16i lo = v16_and_si512(raw, low);
          const v16i hi = v16_and_si512(v16_srli_epi16(raw, 4), low);
          for (int t = 0; t < T; ++t) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.xq + (r0 + t) * K + g * kGroup + c * 8);
            dot[t][0] = v16_dpbusd_small_epi32(dot[t][0], lo, v16_set1_epi32(x4[0]));
            dot[t][kSplit - 1] = v16_dpbusd_small_epi32(dot[t][kSplit - 1], hi, v16_set1_epi32(x4[1]));
          }
        } else {
#if LSSP_AVX512
          for (int t = 0; t < T; ++t) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.xq + (r0 + t) * K + g * kGroup + c * 4);
            dot[t][c % kSplit] = v16_dpbusd_epi32(dot[t][c % kSplit], raw, v16_set1_epi32(x4[0]));
          }
#else  // q * x as (q - 128) * x here, the 128 * sum(x) added once per group below
          const v16i q8 = v16_flip_sign_bits(raw);
          const v16i magnitude = v16_abs_epi8(q8);
          for (int t = 0; t < T; ++t) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.xq + (r0 + t) * K + g * kGroup + c * 4);
            dot[t][c % kSplit] = v16_dot_signed(dot[t][c % kSplit], magnitude, q8, v16_set1_epi32(x4[0]));
          }
#endif
        }
      }
      const v16f dv = v16_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
      const v16f mv = v16_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * 16)));
      for (int t = 0; t < T; ++t) {
        const int64_t r = r0 + t;
        v16i total = kSplit == 2 ? v16_add_epi32(dot[t][0], dot[t][kSplit - 1]) : dot[t][0];
#if !LSSP_AVX512
        if constexpr (Bits == 8) total = v16_add_epi32(total, v16_set1_epi32(128 * a.group_totals[r * G + g]));
#endif
        const v16f sum = v16_cvtepi32_ps(total);
        acc[t] = v16_fmadd_ps(sum, v16_mul_ps(dv, v16_set1_ps(a.row_scales[r * G + g])), acc[t]);
        acc[t] = v16_fmadd_ps(mv, v16_set1_ps(a.group_sums[r * G + g]), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) v16_storeu_ps(y + (r0 + t) * N + nb * 16, acc[t]);
  }
}

#if !LSSP_AVX512
// AVX2, 4-bit: one block's 16 weight rows as two halves of 8 (one register each) against up to 4 activation rows
// r0..r0+T-1; each 64-byte chunk unpacked once and multiplied into every row's sums. One or two rows take both halves
// in one pass (more independent chains hide the FMAs' latency: a lone row's single chain made its matmul slower than
// two rows'), more rows one half per pass, the second reading the block from L1 (their sums stay in registers, no
// spills). A group's 32 products per row are summed in int16 before widening: each int16 lane adds 16 products of at
// most 15 * 127, below 2^15, so the sums are the exact ones ``tile`` computes, and each output is computed the same
// way whatever T: a row's numbers do not depend on the others.
template <int T>
inline void block_q4_avx2(const uint8_t* w, const at::Half* d, const at::Half* m, const Quantized& a, float* y,
                          int64_t r0, int64_t K, int64_t N, int64_t col, bool prefetch) {
  static_assert(T >= 1 && T <= 4, "up to 4 rows keep their sums in registers");
  constexpr int H = T <= 2 ? 2 : 1;  // halves per pass
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[H][T];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i dot[H][T];
      for (int c = 0; c < 4; ++c) {
        const uint8_t* at = w + (g * 4 + c) * 64;
        if (prefetch && h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
        for (int h = 0; h < H; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * (h0 + h)));
          const __m256i lo = _mm256_and_si256(raw, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          for (int t = 0; t < T; ++t) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.xq + (r0 + t) * K + g * kGroup);
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[2 * c])),
                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[2 * c + 1])));
            dot[h][t] = c == 0 ? pairs : _mm256_add_epi16(dot[h][t], pairs);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16 + 8 * (h0 + h))));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * 16 + 8 * (h0 + h))));
        for (int t = 0; t < T; ++t) {
          const int64_t r = r0 + t;
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[h][t], ones));
          acc[h][t] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dv, _mm256_set1_ps(a.row_scales[r * G + g])), acc[h][t]);
          acc[h][t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.group_sums[r * G + g]), acc[h][t]);
        }
      }
    }
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + (r0 + t) * N + col + 8 * (h0 + h), acc[h][t]);
  }
}

// Rows r0..r0+T-1 (T <= 8) for the blocks nb0..nb1-1: beyond 4 rows, two passes over each block, the second reading
// its weights from L1 (a block is 16 * K / 2 bytes).
template <int T>
void tile_q4_avx2(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const Quantized& a, float* y,
                  int64_t r0, int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  constexpr int first = T <= 4 ? T : (T + 1) / 2;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint8_t* w = packed + nb * 16 * (K / 2);
    const at::Half* d = scales + nb * 16 * G;
    const at::Half* m = mins + nb * 16 * G;
    block_q4_avx2<first>(w, d, m, a, y, r0, K, N, nb * 16, true);
    if constexpr (T > first) block_q4_avx2<T - first>(w, d, m, a, y, r0 + first, K, N, nb * 16, false);
  }
}

#endif

template <int T, int Bits>
void tile_for(const uint8_t* wp, const at::Half* sp, const at::Half* mp, const Quantized& a, float* yp, int64_t r0,
              int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
#if LSSP_AVX512
  tile<T, Bits>(wp, sp, mp, a, yp, r0, nb0, nb1, K, N);
#else
  if constexpr (Bits == 4) tile_q4_avx2<T>(wp, sp, mp, a, yp, r0, nb0, nb1, K, N);
  else tile<T, Bits>(wp, sp, mp, a, yp, r0, nb0, nb1, K, N);
#endif
}

template <int Bits>
void rows(const uint8_t* wp, const at::Half* sp, const at::Half* mp, const Quantized& a, float* yp, int64_t R,
          int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
  // Up to kRowTile rows per pass over the weights: a verification of K + 1 <= kRowTile tokens reads them once.
  for (int64_t r = 0; r < R; r += kRowTile) {
    switch (std::min<int64_t>(R - r, kRowTile)) {
      case 1: tile_for<1, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 2: tile_for<2, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 3: tile_for<3, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 4: tile_for<4, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 5: tile_for<5, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 6: tile_for<6, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      case 7: tile_for<7, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
      default: tile_for<8, Bits>(wp, sp, mp, a, yp, r, nb0, nb1, K, N); break;
    }
  }
}

// A weight in the kernel's layout, read from its three tensors.
struct Blocks {
  const uint8_t* packed;
  const at::Half* scales;
  const at::Half* mins;
  int64_t N, K;
  int bits;
};

Blocks blocks_of(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t K) {
  const int64_t N = packed.size(0);
  TORCH_CHECK(packed.dim() == 2 && K % kGroup == 0 && N % 16 == 0 && (packed.size(1) == K || packed.size(1) == K / 2),
              "block_mm: K a multiple of 32, N of 16, packed (N, K/2) or (N, K)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              "block_mm: packed uint8, scales and mins float16");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "block_mm: contiguous weights");
  return {packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), N, K,
          packed.size(1) == K ? 8 : 4};
}

// Room for the int8 activations of up to R rows of width K.
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> row_scales, group_sums;
  std::vector<int32_t> group_totals;
  void fit(int64_t R, int64_t K) {
    if (static_cast<int64_t>(xq.size()) < R * K) xq.resize(R * K);
    if (static_cast<int64_t>(row_scales.size()) < R * K / kGroup) {
      row_scales.resize(R * K / kGroup);
      group_sums.resize(R * K / kGroup);
      group_totals.resize(R * K / kGroup);
    }
  }
  Quantized view() const { return {xq.data(), row_scales.data(), group_sums.data(), group_totals.data()}; }
  void quantize(const float* x, int64_t r0, int64_t r1, int64_t K) {  // rows r0..r1-1 of x (R, K), fitted before
    quantize_rows(x, r0, r1, K, xq.data(), row_scales.data(), group_sums.data(), group_totals.data());
  }
};

// Rows 0..R-1 of y (R, N) = x W^T for the blocks of 16 weight rows nb0..nb1-1, from x quantized in ``a``.
void multiply_blocks(const Blocks& w, const Quantized& a, float* y, int64_t R, int64_t nb0, int64_t nb1) {
  if (w.bits == 4) rows<4>(w.packed, w.scales, w.mins, a, y, R, nb0, nb1, w.K, w.N);
  else rows<8>(w.packed, w.scales, w.mins, a, y, R, nb0, nb1, w.K, w.N);
}

// Starts bringing ``bytes`` at p into this core's caches without waiting for them: the small tensors a step between
// matmuls reads (norm weights, cache rows), otherwise cold after the weights streamed through, asked for during the
// matmul before it.
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(at + offset, _MM_HINT_T0);
}

// The threads of one forward in one parallel region: each runs the whole forward's code (``run``), takes its share
// of each step's items (``share``: contiguous, as at::parallel_for hands them out) and waits at ``sync`` for the
// others before the next step reads what they wrote. A parallel region per step costs ~1 us to open and close (150
// a token); a barrier where the threads spin ~0.05 us.
class Team {
 public:
  explicit Team(int size) : size_(std::max(size, 1)) {}
  int size() const { return size_; }
  std::pair<int64_t, int64_t> share(int64_t n, int t) const {
    const int64_t chunk = (n + size_ - 1) / size_;
    return {std::min(n, t * chunk), std::min(n, (t + 1) * chunk)};
  }
  void sync() {
    if (size_ == 1) return;
    const int64_t phase = phase_.load(std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) _mm_pause();
      else std::this_thread::yield();  // a thread descheduled by others' work: give the core back
    }
  }
  // body(t) on each thread t of the team; on one thread where OpenMP gives fewer (nested in another region).
  template <typename Body>
  void run(Body&& body) {
    if (size_ > 1 && !omp_in_parallel()) {
      int got = 0;
#pragma omp parallel num_threads(size_)
      {
#pragma omp single
        got = omp_get_num_threads();
        if (got == size_) body(omp_get_thread_num());
      }
      if (got == size_) return;
    }
    size_ = 1;
    body(0);
  }

 private:
  static constexpr int kSpins = 1 << 14;
  int size_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int64_t> phase_{0};
};

// y (R, N) = x (R, K) W^T, the outputs split between threads by blocks of 16 weight rows.
void matmul(const Blocks& w, const float* x, int64_t R, float* y, Scratch& s) {
  if (R == 0 || w.N == 0) return;
  s.fit(R, w.K);
  at::parallel_for(0, R, kRowsPerThread, [&](int64_t r0, int64_t r1) { s.quantize(x, r0, r1, w.K); });
  const Quantized a = s.view();
  const int64_t blocks = w.N / 16;
  const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
  at::parallel_for(0, blocks, grain, [&](int64_t nb0, int64_t nb1) { multiply_blocks(w, a, y, R, nb0, nb1); });
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 2, "block_mm takes x (R, K) and packed (N, K * bits / 8)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const Blocks w = blocks_of(packed, scales, mins, x.size(1));
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  Scratch s;
  matmul(w, x.data_ptr<float>(), x.size(0), y.data_ptr<float>(), s);
  return y;
}

inline mask16 lanes_from(int64_t left) {  // the first min(left, 16) lanes
#if LSSP_AVX512
  return left >= 16 ? static_cast<mask16>(0xFFFF) : static_cast<mask16>((1u << left) - 1);
#else
  const __m256i n = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, 16)));
  return {_mm256_cmpgt_epi32(n, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(n, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
#endif
}

// e^x in each lane (relative error ~2e-7): x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial.
inline v16f exp512(v16f x) {
  x = v16_max_ps(v16_min_ps(x, v16_set1_ps(88.0f)), v16_set1_ps(-88.0f));
  const v16f n = v16_roundscale_ps(v16_mul_ps(x, v16_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  v16f r = v16_fnmadd_ps(n, v16_set1_ps(0.693145751953125f), x);
  r = v16_fnmadd_ps(n, v16_set1_ps(1.428606765330187e-06f), r);
  v16f p = v16_set1_ps(1.0f / 720);
  p = v16_fmadd_ps(p, r, v16_set1_ps(1.0f / 120));
  p = v16_fmadd_ps(p, r, v16_set1_ps(1.0f / 24));
  p = v16_fmadd_ps(p, r, v16_set1_ps(1.0f / 6));
  p = v16_fmadd_ps(p, r, v16_set1_ps(0.5f));
  p = v16_fmadd_ps(p, r, v16_set1_ps(1.0f));
  p = v16_fmadd_ps(p, r, v16_set1_ps(1.0f));
  return v16_scalef_ps(p, n);
}


// 16 elements of a cache row, float32 or float16, as floats; and back (float16: rounded to nearest, ties to even).
inline v16f load_row(const float* p) { return v16_loadu_ps(p); }
inline v16f load_row(const at::Half* p) { return v16_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store_row(float* p, v16f a) { v16_storeu_ps(p, a); }
#if LSSP_AVX512
inline void store_row(at::Half* p, v16f a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
inline void store_row(at::Half* p, v16f a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// Attention goes over each query's allowed slots in blocks of kSlotBlock (counted in that query's own slots): a
// block's keys and values are read once for every query of a forward that reaches it (the query heads sharing a
// key/value head, and every row), and a query's numbers depend on its own slots alone, whatever the other queries.
constexpr int64_t kSlotBlock = 128;

// Query heads sharing one key/value head attend together, up to kHeadGroup at a time: each key and value row is loaded
// (and widened from float16) once for all of them. Each query's sums run in the order attend_block's do, so a query
// gets the same numbers alone or in a group. Pairs of AVX2 registers are too few to hold a group's sums: one there.
constexpr int kHeadGroup = LSSP_AVX512 ? 4 : 1;

// scores[g * kSlotBlock + c] = scale * (q[g] . the key of slots[c]), four slots at a time (four independent
// chains of FMAs per query, one tree reduction of the four sums). DC: D / 16 where the head size D is a whole number
// of vectors known here (no masks); 0 for any D (float32 rows, masked loads), the same sums either way.
template <int G, int DC, typename T>
void dot_scores_group(const float* const* q, const T* k, int64_t ks, const int64_t* slots, int64_t count,
                      float scale, float* scores, int64_t D = 16 * DC) {
  const int64_t chunks = DC ? DC : (D + 15) / 16;
  const auto load = [D](const auto* p, int64_t d) {  // float16 rows: whole vectors only (DC > 0)
    if constexpr (DC > 0) return load_row(p + d);
    else return v16_maskz_loadu_ps(lanes_from(D - d), p + d);
  };
  int64_t c = 0;
  for (; c + 4 <= count; c += 4) {
    const T* k0 = k + slots[c] * ks;
    const T* k1 = k + slots[c + 1] * ks;
    const T* k2 = k + slots[c + 2] * ks;
    const T* k3 = k + slots[c + 3] * ks;
    v16f a[G][4];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = v16_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t d = 16 * i;
      const v16f x0 = load(k0, d), x1 = load(k1, d), x2 = load(k2, d), x3 = load(k3, d);
      for (int g = 0; g < G; ++g) {
        const v16f qv = load(q[g], d);
        a[g][0] = v16_fmadd_ps(qv, x0, a[g][0]);
        a[g][1] = v16_fmadd_ps(qv, x1, a[g][1]);
        a[g][2] = v16_fmadd_ps(qv, x2, a[g][2]);
        a[g][3] = v16_fmadd_ps(qv, x3, a[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores + g * kSlotBlock + c, _mm_mul_ps(sum4(a[g][0], a[g][1], a[g][2], a[g][3]), _mm_set1_ps(scale)));
  }
  for (; c < count; ++c)
    for (int g = 0; g < G; ++g) {
      v16f acc = v16_setzero_ps();
      for (int64_t i = 0; i < chunks; ++i) acc = v16_fmadd_ps(load(q[g], 16 * i), load(k + slots[c] * ks, 16 * i), acc);
      scores[g * kSlotBlock + c] = v16_reduce_add_ps(acc) * scale;
    }
}

// out[g] (16 V) = the value rows of slots weighted by scores[g * kSlotBlock + c]: each row read once, two
// rows at a time into two sets of accumulators per query (independent chains), added at the end.
template <int G, int V, typename T>
void accumulate_values_group(const T* v, int64_t vs, const float* scores, const int64_t* slots, int64_t count,
                             float* const* out) {
  v16f a[G][V], b[G][V];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) a[g][i] = b[g][i] = v16_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= count; c += 2) {
    const T* v0 = v + slots[c] * vs;
    const T* v1 = v + slots[c + 1] * vs;
    for (int i = 0; i < V; ++i) {
      const v16f x0 = load_row(v0 + 16 * i), x1 = load_row(v1 + 16 * i);
      for (int g = 0; g < G; ++g) {
        a[g][i] = v16_fmadd_ps(v16_set1_ps(scores[g * kSlotBlock + c]), x0, a[g][i]);
        b[g][i] = v16_fmadd_ps(v16_set1_ps(scores[g * kSlotBlock + c + 1]), x1, b[g][i]);
      }
    }
  }
  if (c < count) {
    const T* v0 = v + slots[c] * vs;
    for (int i = 0; i < V; ++i) {
      const v16f x0 = load_row(v0 + 16 * i);
      for (int g = 0; g < G; ++g) a[g][i] = v16_fmadd_ps(v16_set1_ps(scores[g * kSlotBlock + c]), x0, a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < V; ++i) v16_storeu_ps(out[g] + 16 * i, v16_add_ps(a[g][i], b[g][i]));
}

// scores (count) -> exp(score - top): ``top`` their largest, ``total`` the sum of the exponentials.
inline void exponentiate_scores(float* scores, int64_t count, float& top, float& total) {
  v16f tops = v16_set1_ps(-INFINITY);
  for (int64_t c = 0; c < count; c += 16) tops = v16_max_ps(tops, v16_mask_loadu_ps(tops, lanes_from(count - c), scores + c));
  top = v16_reduce_max_ps(tops);
  v16f sums = v16_setzero_ps();
  for (int64_t c = 0; c < count; c += 16) {
    const mask16 lanes = lanes_from(count - c);
    const v16f e = exp512(v16_sub_ps(v16_maskz_loadu_ps(lanes, scores + c), v16_set1_ps(top)));
    v16_mask_storeu_ps(scores + c, lanes, e);
    sums = v16_mask_add_ps(sums, lanes, sums, e);
  }
  total = v16_reduce_add_ps(sums);
}

// One query q (D) over ``count`` slots (a block of its allowed slots, slot j's key at k + j * ks, value at v + j * vs):
// ``top`` its largest score, ``total`` the sum of exp(score - top), acc (D) the values weighted by those, unscaled.
template <typename T>
void attend_block(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t D,
                  const int64_t* slots, int64_t count, float scale, float* scores, float* acc, float& top,
                  float& total) {
  switch (D) {  // the common head sizes in whole vectors, unmasked
    case 64: dot_scores_group<1, 4>(&q, k, ks, slots, count, scale, scores); break;
    case 128: dot_scores_group<1, 8>(&q, k, ks, slots, count, scale, scores); break;
    default:
      if constexpr (std::is_same_v<T, float>) dot_scores_group<1, 0>(&q, k, ks, slots, count, scale, scores, D);
      else TORCH_CHECK(false, "attention: a float16 cache takes heads of 64 or 128");
  }
  exponentiate_scores(scores, count, top, total);
  int64_t c = 0;
  switch (D) {  // the common head sizes: each value row read once, whole, into registers
    case 64: accumulate_values_group<1, 4>(v, vs, scores, slots, count, &acc); return;
    case 128: accumulate_values_group<1, 8>(v, vs, scores, slots, count, &acc); return;
    default: break;
  }
  if constexpr (!std::is_same_v<T, float>) return;  // (not reached)
  else for (int64_t d = 0; d < D; d += 16) {  // four accumulators over the slots in turn, added at the end
    const mask16 lanes = lanes_from(D - d);
    v16f a0 = v16_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (c = 0; c + 4 <= count; c += 4) {
      a0 = v16_fmadd_ps(v16_set1_ps(scores[c]), v16_maskz_loadu_ps(lanes, v + slots[c] * vs + d), a0);
      a1 = v16_fmadd_ps(v16_set1_ps(scores[c + 1]), v16_maskz_loadu_ps(lanes, v + slots[c + 1] * vs + d), a1);
      a2 = v16_fmadd_ps(v16_set1_ps(scores[c + 2]), v16_maskz_loadu_ps(lanes, v + slots[c + 2] * vs + d), a2);
      a3 = v16_fmadd_ps(v16_set1_ps(scores[c + 3]), v16_maskz_loadu_ps(lanes, v + slots[c + 3] * vs + d), a3);
    }
    for (; c < count; ++c)
      a0 = v16_fmadd_ps(v16_set1_ps(scores[c]), v16_maskz_loadu_ps(lanes, v + slots[c] * vs + d), a0);
    v16_mask_storeu_ps(acc + d, lanes, v16_add_ps(v16_add_ps(a0, a1), v16_add_ps(a2, a3)));
  }
}

// out (D) = a query's attention from its blocks' ``tops``, ``totals`` and ``accs`` (blocks x D), in block order.
// weights: room for ``blocks``.
void combine_blocks(const float* tops, const float* totals, const float* accs, int64_t blocks, int64_t D, float* out,
                    float* weights) {
  v16f most = v16_set1_ps(-INFINITY);
  for (int64_t j = 0; j < blocks; j += 16) most = v16_max_ps(most, v16_mask_loadu_ps(most, lanes_from(blocks - j), tops + j));
  const float top = v16_reduce_max_ps(most);
  v16f sums = v16_setzero_ps();
  for (int64_t j = 0; j < blocks; j += 16) {
    const mask16 lanes = lanes_from(blocks - j);
    const v16f e = exp512(v16_sub_ps(v16_maskz_loadu_ps(lanes, tops + j), v16_set1_ps(top)));
    v16_mask_storeu_ps(weights + j, lanes, e);
    sums = v16_mask_add_ps(sums, lanes, sums, v16_mul_ps(e, v16_maskz_loadu_ps(lanes, totals + j)));
  }
  const float total = v16_reduce_add_ps(sums);
  const v16f inv = v16_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
  for (int64_t d = 0; d < D; d += 16) {
    const mask16 lanes = lanes_from(D - d);
    v16f o = v16_setzero_ps();
    for (int64_t j = 0; j < blocks; ++j) o = v16_fmadd_ps(v16_maskz_loadu_ps(lanes, accs + j * D + d), v16_set1_ps(weights[j]), o);
    v16_mask_storeu_ps(out + d, lanes, v16_mul_ps(o, inv));
  }
}

// One query row q (D) over its ``count`` allowed slots (``slots``, in order), block by block: the numbers the
// decoder's shared-block attention gives the same query. scratch: room for kSlotBlock + ceil(count / kSlotBlock) * (D + 3).
template <typename T>
void attend_row(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t D,
                const int64_t* slots, int64_t count, float scale, float* out, float* scratch) {
  const int64_t blocks = (count + kSlotBlock - 1) / kSlotBlock;
  float* scores = scratch;
  float* tops = scores + kSlotBlock;
  float* totals = tops + blocks;
  float* accs = totals + blocks;
  for (int64_t j = 0; j < blocks; ++j)
    attend_block(q, k, ks, v, vs, D, slots + j * kSlotBlock, std::min(kSlotBlock, count - j * kSlotBlock), scale,
                 scores, accs + j * D, tops[j], totals[j]);
  combine_blocks(tops, totals, accs, blocks, D, out, accs + blocks * D);
}

// G queries over one block of slots, as attend_block takes each: acc[g] (D), top[g], total[g].
template <int G, int DC, typename T>
void attend_block_group(const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs, const int64_t* slots,
                        int64_t count, float scale, float* scores, float* const* acc, float* const* top,
                        float* const* total) {
  dot_scores_group<G, DC>(q, k, ks, slots, count, scale, scores);
  for (int g = 0; g < G; ++g) exponentiate_scores(scores + g * kSlotBlock, count, *top[g], *total[g]);
  if constexpr (G * DC <= 12) {
    accumulate_values_group<G, DC>(v, vs, scores, slots, count, acc);
  } else {
    for (int g = 0; g < G; ++g) accumulate_values_group<1, DC>(v, vs, scores + g * kSlotBlock, slots, count, acc + g);
  }
}

// G queries over one block, by attend_block_group for a head size of 64 or 128.
template <int G, typename T>
void attend_block_group_of(int64_t D, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                           const int64_t* slots, int64_t count, float scale, float* scores, float* const* acc,
                           float* const* top, float* const* total) {
  if (D == 64) attend_block_group<G, 4>(q, k, ks, v, vs, slots, count, scale, scores, acc, top, total);
  else attend_block_group<G, 8>(q, k, ks, v, vs, slots, count, scale, scores, acc, top, total);
}

// n query heads sharing a key/value head over one block: attend_block's numbers for each (acc[h], *top[h],
// *total[h]), up to kHeadGroup heads at a time where the head size is 64 or 128. scores: kHeadGroup * kSlotBlock.
template <typename T>
void attend_block_heads(int64_t n, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t D,
                        const int64_t* slots, int64_t count, float scale, float* scores, float* const* acc,
                        float* const* top, float* const* total) {
  const bool grouped = kHeadGroup > 1 && (D == 64 || D == 128);
  for (int64_t h = 0; h < n;) {
    const int64_t take = grouped ? std::min<int64_t>(kHeadGroup, n - h) : 1;
    switch (take) {
      case 4: attend_block_group_of<4>(D, q + h, k, ks, v, vs, slots, count, scale, scores, acc + h, top + h, total + h); break;
      case 3: attend_block_group_of<3>(D, q + h, k, ks, v, vs, slots, count, scale, scores, acc + h, top + h, total + h); break;
      case 2: attend_block_group_of<2>(D, q + h, k, ks, v, vs, slots, count, scale, scores, acc + h, top + h, total + h); break;
      default: attend_block(q[h], k, ks, v, vs, D, slots, count, scale, scores, acc[h], *top[h], *total[h]); break;
    }
    h += take;
  }
}

// The slots a query row sees, in order: those ``sees`` allows (null: 0..S-1). Returns their count.
int64_t allowed_slots(const bool* sees, int64_t S, int64_t* slots) {
  int64_t count = 0;
  for (int64_t j = 0; j < S; ++j)
    if (!sees || sees[j]) slots[count++] = j;
  return count;
}

at::Tensor bool_mask(const c10::optional<at::Tensor>& allowed_in, int64_t B, int64_t R, int64_t S) {
  if (!allowed_in.has_value()) return at::Tensor();
  at::Tensor allowed = allowed_in->to(at::kBool).contiguous();
  TORCH_CHECK(allowed.dim() == 3 && (allowed.size(0) == B || allowed.size(0) == 1) && allowed.size(1) == R &&
              allowed.size(2) == S, "attention: allowed (B or 1, rows, slots)");
  return allowed;
}

// lssp::row_attention: attention of each query row by itself, as a one-token forward computes it.
// q (B, H, R, D); keys, values (B, H, S, D) (any strides, the last dimension contiguous); allowed: none (every slot)
// or bool (B or 1, R, S), the slots row r sees. Row r goes over its allowed slots in order, one by one, whatever R and
// whatever the other rows and slots hold: a verification forward of n tokens, or a batch whose rows have holes, gives
// each query the numbers of a one-token forward of its row alone.
at::Tensor row_attention(const at::Tensor& q_in, const at::Tensor& keys_in, const at::Tensor& values_in,
                         const c10::optional<at::Tensor>& allowed_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && keys_in.dim() == 4 && values_in.sizes() == keys_in.sizes(),
              "row_attention takes q (B, H, R, D) and keys, values (B, H, S, D)");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor keys = keys_in.to(at::kFloat), values = values_in.to(at::kFloat);
  if (keys.stride(3) != 1) keys = keys.contiguous();
  if (values.stride(3) != 1) values = values.contiguous();
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(3) == D, "row_attention: shapes");
  const at::Tensor allowed = bool_mask(allowed_in, B, R, S);
  const bool* ap = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  const int64_t a_batch = allowed.defined() && allowed.size(0) == B ? R * S : 0;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(S);
    std::vector<float> scratch(kSlotBlock + (S + kSlotBlock - 1) / kSlotBlock * (D + 3));
    for (int64_t bhr = begin; bhr < end; ++bhr) {
      const int64_t b = bhr / (H * R), h = (bhr / R) % H, r = bhr % R;
      const int64_t count = allowed_slots(ap ? ap + b * a_batch + r * S : nullptr, S, slots.data());
      attend_row(qp + bhr * D, kp + b * keys.stride(0) + h * keys.stride(1), keys.stride(2),
                 vp + b * values.stride(0) + h * values.stride(1), values.stride(2), D, slots.data(), count,
                 static_cast<float>(scale), op + bhr * D, scratch.data());
    }
  });
  return out.to(q_in.scalar_type());
}

// Rows r0..r1-1 of x (R, D) -> out (R, D), its rows ``out_stride`` apart (0: D): RMS norm with ``weight`` (null:
// none, a copy).
void rms_norm(const float* x, int64_t r0, int64_t r1, int64_t D, const float* weight, float eps, float* out,
              int64_t out_stride = 0) {
  const int64_t stride = out_stride > 0 ? out_stride : D;
  for (int64_t r = r0; r < r1; ++r) {
    const float* v = x + r * D;
    float* o = out + r * stride;
    if (!weight) {
      std::copy(v, v + D, o);
      continue;
    }
    v16f squares = v16_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const v16f a = v16_maskz_loadu_ps(lanes_from(D - d), v + d);
      squares = v16_fmadd_ps(a, a, squares);
    }
    const v16f inv = v16_set1_ps(1.0f / std::sqrt(v16_reduce_add_ps(squares) / static_cast<float>(D) + eps));
    for (int64_t d = 0; d < D; d += 16) {
      const mask16 lanes = lanes_from(D - d);
      v16_mask_storeu_ps(o + d, lanes, v16_mul_ps(v16_mul_ps(v16_maskz_loadu_ps(lanes, v + d), inv),
                                                  v16_maskz_loadu_ps(lanes, weight + d)));
    }
  }
}

// v (hd) rotated in place: v * cos + swap_halves(v) * sin (sin negated on its first half).
void rotate(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < half; d += 16) {
    const mask16 lanes = lanes_from(half - d);
    const v16f a = v16_maskz_loadu_ps(lanes, v + d), b = v16_maskz_loadu_ps(lanes, v + half + d);
    const v16f first = v16_fmadd_ps(b, v16_maskz_loadu_ps(lanes, sin + d),
                                    v16_mul_ps(a, v16_maskz_loadu_ps(lanes, cos + d)));
    const v16f second = v16_fmadd_ps(a, v16_maskz_loadu_ps(lanes, sin + half + d),
                                     v16_mul_ps(b, v16_maskz_loadu_ps(lanes, cos + half + d)));
    v16_mask_storeu_ps(v + d, lanes, first);
    v16_mask_storeu_ps(v + half + d, lanes, second);
  }
}

// A float32 row of hd into a cache row of T.
template <typename T>
void put_row(const float* from, T* to, int64_t hd) {
  if constexpr (std::is_same_v<T, float>) std::copy(from, from + hd, to);
  else for (int64_t d = 0; d < hd; d += 16) store_row(to + d, v16_loadu_ps(from + d));
}

// The attention of one forward, the same in every layer: each live row's allowed slots (causal rows: the first
// start + i + 1, read from ``iota``), the units of work (b, slot block j), and room for the partial results of rows
// with more than one block.
struct AttentionPlan {
  int64_t S, heads, group, hd, parts, threads;
  bool masked;
  std::vector<int64_t> counts, base, row_slots, iota, most, batch_of;
  std::vector<std::vector<int64_t>> rows_of;
  std::vector<std::pair<int64_t, int64_t>> units;
  std::vector<float> tops, totals, accs;

  AttentionPlan(const std::vector<int64_t>& live, int64_t n, int64_t start, int64_t S_, const bool* ap, int64_t a_batch,
                int64_t B, int64_t heads_, int64_t kv_heads, int64_t hd_)
      : S(S_), heads(heads_), group(heads_ / kv_heads), hd(hd_), masked(ap != nullptr), counts(live.size()),
        base(live.size()), row_slots(ap ? live.size() * S_ : 0), iota(ap ? 0 : S_), most(B, 0),
        batch_of(live.size()), rows_of(B) {
    for (int64_t j = 0; j < static_cast<int64_t>(iota.size()); ++j) iota[j] = j;
    int64_t partials = 0;
    for (int64_t r = 0; r < static_cast<int64_t>(live.size()); ++r) {
      const int64_t b = live[r] / n, i = live[r] % n;
      counts[r] = ap ? allowed_slots(ap + b * a_batch + i * S, S, row_slots.data() + r * S) : start + i + 1;
      rows_of[b].push_back(r);
      batch_of[r] = b;
      most[b] = std::max(most[b], blocks_of_row(r));
      base[r] = partials;
      if (blocks_of_row(r) > 1) partials += heads * blocks_of_row(r);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < most[b]; ++j) units.emplace_back(b, j);
    tops.resize(partials);
    totals.resize(partials);
    accs.resize(partials * hd);
    // A unit takes the query heads of one key/value head, or of one query head where that leaves threads idle.
    const int64_t units_kv = static_cast<int64_t>(units.size()) * kv_heads;
    parts = units_kv >= 2 * at::get_num_threads() ? kv_heads : heads;
    threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(units.size()) * parts));
  }
  int64_t blocks_of_row(int64_t r) const { return (counts[r] + kSlotBlock - 1) / kSlotBlock; }
  const int64_t* slots_of(int64_t r) const { return masked ? row_slots.data() + r * S : iota.data(); }
};

inline const float* q_of(const float* qkv, int64_t width, int64_t hd, int64_t r, int64_t head) {
  return qkv + r * width + head * hd;
}

// Room for one thread's attention of up to ``heads`` query heads at a time: scores, the partial results of a row's
// only block before they are combined, and pointers to each head's query and results. One per thread, kept.
struct HeadScratch {
  std::vector<float> scores, local;
  std::vector<const float*> q;
  std::vector<float*> acc, top, total;
  static HeadScratch& of_thread(int64_t heads, int64_t hd) {
    thread_local HeadScratch s;
    const auto grow = [](auto& v, int64_t size) { if (static_cast<int64_t>(v.size()) < size) v.resize(size); };
    grow(s.scores, kHeadGroup * kSlotBlock + hd + 3);  // attend_row's room too
    grow(s.local, heads * (hd + 2) + 16);
    grow(s.q, heads);
    for (auto* v : {&s.acc, &s.top, &s.total}) grow(*v, heads);
    return s;
  }
};

// Query heads first..first+n-1 (sharing one key/value head) of row r over block j of its slots: into ``attn``
// directly where that is the row's only block (as attend_row), else into the plan's partial results for block j.
template <typename T>
void attend_heads(AttentionPlan& p, const float* qkv, int64_t width, const T* kb, int64_t ks, const T* vb, int64_t vs,
                  float scale, int64_t r, int64_t j, int64_t first, int64_t n, float* attn, HeadScratch& s) {
  const int64_t hd = p.hd, count = p.counts[r], c0 = j * kSlotBlock, blocks = p.blocks_of_row(r);
  float* out = attn + r * p.heads * hd + first * hd;
  if (count == 0) {  // a row that sees no slot attends to nothing: zeros
    std::fill(out, out + n * hd, 0.0f);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    s.q[i] = q_of(qkv, width, hd, r, first + i);
    const int64_t item = p.base[r] + (first + i) * blocks + j;
    s.acc[i] = blocks == 1 ? s.local.data() + i * hd : p.accs.data() + item * hd;
    s.top[i] = blocks == 1 ? s.local.data() + n * hd + i : &p.tops[item];
    s.total[i] = blocks == 1 ? s.local.data() + n * hd + n + i : &p.totals[item];
  }
  attend_block_heads(n, s.q.data(), kb, ks, vb, vs, hd, p.slots_of(r) + c0, std::min(kSlotBlock, count - c0), scale,
                     s.scores.data(), s.acc.data(), s.top.data(), s.total.data());
  if (blocks == 1)
    for (int64_t i = 0; i < n; ++i)
      combine_blocks(s.top[i], s.total[i], s.acc[i], 1, hd, out + i * hd, s.local.data() + n * (hd + 2));
}

// attn (rows, heads * hd) = each query's attention over its slots of a cache of T, by units (b, slot block j,
// key/value head or query head): a unit reads its block's keys and values once for its queries in every row reaching
// the block; a thread done with a unit takes the next one not taken (``next``, 0 at first). Where every row has one
// block (a short context) the units are (row, key/value head), or (row, query head) where too few for the threads,
// taken in runs. Run by every thread t of ``team``, the caller syncing after. Each query gets the numbers attend_row
// gives it.
template <typename T>
void attend_layer(AttentionPlan& p, const float* qkv, int64_t width, const at::Tensor& keys, const at::Tensor& values,
                  float scale, float* attn, Team& team, int t, std::atomic<int64_t>& next) {
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t hd = p.hd, heads = p.heads, rows = static_cast<int64_t>(p.counts.size());
  const auto keys_of = [&](int64_t b, int64_t head) { return kp + b * keys.stride(0) + (head / p.group) * keys.stride(1); };
  const auto values_of = [&](int64_t b, int64_t head) {
    return vp + b * values.stride(0) + (head / p.group) * values.stride(1);
  };
  if (p.tops.empty()) {  // one block per row (a short context)
    const int64_t per = kHeadGroup > 1 && heads / p.group * rows >= 2 * team.size() ? p.group : 1;
    const auto [begin, end] = team.share(heads / per * rows, t);
    HeadScratch& s = HeadScratch::of_thread(per, hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item / rows * per, r = item % rows, b = p.batch_of[r];
      if (per == 1)  // a query by itself
        attend_row(q_of(qkv, width, hd, r, first), keys_of(b, first), keys.stride(2), values_of(b, first),
                   values.stride(2), hd, p.slots_of(r), p.counts[r], scale, attn + r * heads * hd + first * hd,
                   s.scores.data());
      else
        attend_heads(p, qkv, width, keys_of(b, first), keys.stride(2), values_of(b, first), values.stride(2), scale, r,
                     0, first, per, attn, s);
    }
    return;
  }
  const auto [z0, z1] = team.share(rows, t);
  for (int64_t r = z0; r < z1; ++r)  // a row that sees no slot (no block) attends to nothing: zeros
    if (p.counts[r] == 0) std::fill(attn + r * heads * hd, attn + (r + 1) * heads * hd, 0.0f);
  const int64_t units = static_cast<int64_t>(p.units.size()) * p.parts;
  if (t < p.threads) {
    HeadScratch& s = HeadScratch::of_thread(heads, hd);
    for (int64_t u = next++; u < units; u = next++) {
      const int64_t b = p.units[u / p.parts].first, j = p.units[u / p.parts].second, part = u % p.parts;
      const int64_t first = part * heads / p.parts, last = (part + 1) * heads / p.parts;  // query heads
      for (const int64_t r : p.rows_of[b])
        if (p.counts[r] > j * kSlotBlock)
          attend_heads(p, qkv, width, keys_of(b, first), keys.stride(2), values_of(b, first), values.stride(2), scale,
                       r, j, first, last - first, attn, s);
    }
  }
  team.sync();
  const auto [c0, c1] = team.share(rows * heads, t);
  std::vector<float> weights(c0 < c1 ? *std::max_element(p.most.begin(), p.most.end()) : 0);
  for (int64_t item = c0; item < c1; ++item) {
    const int64_t r = item / heads, head = item % heads, blocks = p.blocks_of_row(r);
    if (blocks < 2) continue;
    const int64_t first = p.base[r] + head * blocks;
    combine_blocks(p.tops.data() + first, p.totals.data() + first, p.accs.data() + first * hd, blocks, hd,
                   attn + r * heads * hd + head * hd, weights.data());
  }
}

// Tensors kept on this side for later calls, by handle (``keep``; ``release`` lets them go): a model's decoder stack,
// 14 tensors a layer, which cost ~0.25 us each to pass to an op from Python (~110 us a forward of 30 layers).
std::mutex kept_mutex;
std::vector<std::shared_ptr<const std::vector<at::Tensor>>> kept;

int64_t keep(at::TensorList tensors) {
  std::lock_guard<std::mutex> lock(kept_mutex);
  kept.push_back(std::make_shared<const std::vector<at::Tensor>>(tensors.vec()));
  return static_cast<int64_t>(kept.size()) - 1;
}

void release(int64_t handle) {
  std::lock_guard<std::mutex> lock(kept_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(kept.size()), "release: no such handle");
  kept[handle].reset();
}

std::shared_ptr<const std::vector<at::Tensor>> kept_at(int64_t handle) {
  std::lock_guard<std::mutex> lock(kept_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(kept.size()) && kept[handle], "no stack kept as ",
              handle);
  return kept[handle];
}

std::vector<at::Tensor> kept_tensors(int64_t handle) { return *kept_at(handle); }

constexpr int64_t kPerLayer = 14;  // input norm, qkv (3), o (3), post-attention norm, gate|up (3), down (3)

// lssp::decoder: Llama decoder layers over hidden (B, n, D) float32, one call for the whole stack, every layer's
// Linears in the kernel's blocks. weights: kPerLayer tensors per layer (an input norm with no element: none);
// cache: keys and values of each layer (B, kv_heads, capacity, hd) float32, written at slots start..start+n-1;
// cos, sin (B or 1, n, hd); allowed: bool (B or 1, n, start + n) or none (causal). Each row is computed by itself,
// as row_attention and block_mm do: a forward of n tokens gives each position the numbers of a one-token forward.
// Returns the last hidden states (B, n, D), after ``final_norm`` where given, and with ``output`` (an output layer's
// packed, scales, mins) the logits of each row's last ``keep`` positions (all where 0), (B, keep, N); else no logits.
// used: none (every position holds a token) or bool (B, n), false at a hole (a batch's padding): a hole is not
// computed (its hidden states and logits are zeros, its cache slot is left as it was), so padding costs nothing.
// embeds (B, n, D) float32 with embed_norm (D,): an EAGLE-3 layer. The first layer's queries, keys and values read
// [embed_norm(embeds), input norm(hidden)] (their weights 2D inputs wide), hidden staying the residual; the hidden
// states returned are then those before final_norm (the head feeds them back), the logits those after it.
// stack >= 0: the weights are a stack ``keep`` holds (``weights`` empty), its layers from ``stack_layer`` on, as many as
// ``cache`` has. The layers run in one team of threads (``Team``), each step's work shared out, a barrier between.
// The rows of table (V, D) float32 that ids (B, n) name: (B, n, D).
at::Tensor embedded(const at::Tensor& table, const at::Tensor& ids_in) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous() && ids_in.dim() == 2,
              "decoder: with ids (B, n), hidden is the embedding table (V, D) float32");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t V = table.size(0), D = table.size(1);
  at::Tensor rows = at::empty({ids.size(0), ids.size(1), D}, table.options());
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t id = ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(id >= 0 && id < V, "decoder: a token id out of the embedding table");
    std::copy(table.data_ptr<float>() + id * D, table.data_ptr<float>() + (id + 1) * D, rows.data_ptr<float>() + i * D);
  }
  return rows;
}

std::tuple<at::Tensor, at::Tensor> decoder(const at::Tensor& hidden_arg, const at::Tensor& cos_arg, const at::Tensor& sin_arg,
                   const c10::optional<at::Tensor>& allowed_in, at::TensorList weights, at::TensorList cache,
                   int64_t start, int64_t heads, int64_t kv_heads, double eps, double scale,
                   const c10::optional<at::Tensor>& final_norm, at::TensorList output, int64_t keep,
                   const c10::optional<at::Tensor>& used_in, const c10::optional<at::Tensor>& embeds_in,
                   const c10::optional<at::Tensor>& embed_norm, int64_t stack, int64_t stack_layer,
                   const c10::optional<at::Tensor>& ids_in, int64_t rope_start) {
  // With ids, hidden is the embedding table they index; with rope_start >= 0, cos and sin are tables (1, >= rope_start
  // + n, hd) whose rows from rope_start are the positions': no op before this one in a plain forward.
  const bool by_ids = ids_in.has_value() && ids_in->defined();
  const at::Tensor hidden_in = by_ids ? embedded(hidden_arg, *ids_in) : hidden_arg;
  TORCH_CHECK(hidden_in.dim() == 3 && hidden_in.scalar_type() == at::kFloat, "decoder: hidden (B, n, D) float32");
  const auto rope_rows = [&](const at::Tensor& table) {
    if (rope_start < 0) return table;
    TORCH_CHECK(table.dim() == 3 && table.size(1) >= rope_start + hidden_in.size(1), "decoder: rope tables too short");
    return table.narrow(1, rope_start, hidden_in.size(1));
  };
  const at::Tensor cos_in = rope_rows(cos_arg), sin_in = rope_rows(sin_arg);
  std::shared_ptr<const std::vector<at::Tensor>> held;  // the kept stack, while this call reads it
  if (stack >= 0) {
    held = kept_at(stack);
    const int64_t from = stack_layer * kPerLayer, count = static_cast<int64_t>(cache.size()) / 2 * kPerLayer;
    TORCH_CHECK(weights.empty() && stack_layer >= 0 && from + count <= static_cast<int64_t>(held->size()),
                "decoder: weights from a kept stack or from the call, layers within it");
    weights = at::TensorList(held->data() + from, count);
  }
  const int64_t L = static_cast<int64_t>(weights.size()) / kPerLayer;
  TORCH_CHECK(L >= 1 && L * kPerLayer == static_cast<int64_t>(weights.size()) &&
              static_cast<int64_t>(cache.size()) == 2 * L, "decoder: 14 weights and 2 cache tensors per layer");
  const int64_t B = hidden_in.size(0), n = hidden_in.size(1), D = hidden_in.size(2), S = start + n;
  const int64_t hd = cache[0].size(3), group = heads / kv_heads;
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == n && cos.size(2) == hd &&
              sin.sizes() == cos.sizes(), "decoder: cos, sin (B or 1, n, head_dim)");
  const at::Tensor allowed = bool_mask(allowed_in, B, n, S);
  const bool* ap = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  const int64_t a_batch = allowed.defined() && allowed.size(0) == B ? n * S : 0;
  const int64_t c_batch = cos.size(0) == B ? n * hd : 0;
  const bool half = cache[0].scalar_type() == at::kHalf;
  for (const at::Tensor& t : cache)
    TORCH_CHECK(t.scalar_type() == cache[0].scalar_type() && (half || t.scalar_type() == at::kFloat) && t.dim() == 4 &&
                t.size(0) == B && t.size(1) == kv_heads && t.size(2) >= S && t.size(3) == hd && t.stride(3) == 1,
                "decoder: cache (B, kv_heads, >= slots, hd), all float32 or all float16");
  TORCH_CHECK(!half || hd == 64 || hd == 128, "decoder: a float16 cache takes heads of 64 or 128");
  // The positions computed (b * n + i), each a row of the buffers below: all of them, or those ``used`` marks.
  std::vector<int64_t> live;
  if (used_in.has_value() && used_in->defined()) {
    const at::Tensor used = used_in->to(at::kBool).contiguous();
    TORCH_CHECK(used.dim() == 2 && used.size(0) == B && used.size(1) == n, "decoder: used (B, n) bool");
    for (int64_t r = 0; r < B * n; ++r)
      if (used.data_ptr<bool>()[r]) live.push_back(r);
  } else {
    for (int64_t r = 0; r < B * n; ++r) live.push_back(r);
  }
  const int64_t R = static_cast<int64_t>(live.size());
  const bool holes = R < B * n;
  const at::Tensor live_index = holes ? at::tensor(live, at::TensorOptions().dtype(at::kLong)) : at::Tensor();
  at::Tensor hidden = holes ? hidden_in.contiguous().reshape({B * n, D}).index_select(0, live_index)
                            : hidden_in.contiguous().clone();
  float* h = hidden.data_ptr<float>();
  const bool two_inputs = embeds_in.has_value() && embeds_in->defined();
  at::Tensor embeds;
  if (two_inputs) {
    TORCH_CHECK(embeds_in->sizes() == hidden_in.sizes() && embeds_in->scalar_type() == at::kFloat &&
                embed_norm.has_value() && embed_norm->scalar_type() == at::kFloat && embed_norm->numel() == D &&
                embed_norm->is_contiguous() && weights[0].numel() == D,
                "decoder: embeds (B, n, D) float32 with embed_norm (D,) float32 and an input norm");
    embeds = holes ? embeds_in->contiguous().reshape({B * n, D}).index_select(0, live_index) : embeds_in->contiguous();
  }
  const int64_t width = (heads + 2 * kv_heads) * hd;
  const int64_t inner = weights[8].size(0) / 2;
  std::vector<float> x(R * (two_inputs ? 2 * D : D)), qkv(R * width), attn(R * heads * hd), proj(R * D),
      gate_up(R * 2 * inner), act(R * inner);
  AttentionPlan plan(live, n, start, S, ap, a_batch, B, heads, kv_heads, hd);
  std::vector<Blocks> linears;  // each layer's qkv, o, gate_up, down
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    linears.push_back(blocks_of(w[1], w[2], w[3], l == 0 && two_inputs ? 2 * D : D));
    linears.push_back(blocks_of(w[4], w[5], w[6], heads * hd));
    linears.push_back(blocks_of(w[8], w[9], w[10], D));
    linears.push_back(blocks_of(w[11], w[12], w[13], inner));
  }
  const bool normed_apart = final_norm.has_value() && final_norm->defined() && two_inputs;
  std::vector<float> apart(normed_apart ? R * D : 0);  // an EAGLE-3 layer's normed rows, its hidden states kept
  if (final_norm.has_value() && final_norm->defined())
    TORCH_CHECK(final_norm->scalar_type() == at::kFloat && final_norm->numel() == D && final_norm->is_contiguous(),
                "decoder: final_norm (D,) float32");
  const float* last_norm = final_norm.has_value() && final_norm->defined() ? final_norm->data_ptr<float>() : nullptr;
  Scratch s;
  s.fit(std::max<int64_t>(R, 1), std::max({two_inputs ? 2 * D : D, heads * hd, inner}));
  const Quantized quantized = s.view();
  std::unique_ptr<std::atomic<int64_t>[]> taken(new std::atomic<int64_t>[L]);  // each layer's attention units handed out
  for (int64_t l = 0; l < L; ++l) taken[l] = 0;
  Team team(R > 0 ? at::get_num_threads() : 1);
  LSSP_LAP_START();
  team.run([&](int t) {
    const std::pair<int64_t, int64_t> rows = team.share(R, t);  // this thread's rows in the steps row by row
    const int64_t r0 = rows.first, r1 = rows.second;
    // y = in W^T, in's rows quantized first; ``soon`` (this thread's rows' next reads, prefetched) before the blocks
    const auto multiply = [&](const Blocks& w, const float* in, float* y, auto&& soon) {
      s.quantize(in, r0, r1, w.K);
      team.sync();
      if (r0 < r1) soon();
      const auto [nb0, nb1] = team.share(w.N / 16, t);
      multiply_blocks(w, quantized, y, R, nb0, nb1);
      team.sync();
    };
    const auto add_rows = [&](const float* from) {  // the residual: h += from on this thread's rows
      for (int64_t j = r0 * D; j < r1 * D; ++j) h[j] += from[j];
    };
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const at::Tensor& keys = cache[2 * l];
      const at::Tensor& values = cache[2 * l + 1];
      const float* input_norm = w[0].numel() ? w[0].data_ptr<float>() : nullptr;
      if (l > 0) add_rows(proj.data());  // the layer before's MLP
      LSSP_LAP_IF(t == 0, 9);
      if (l == 0 && two_inputs) {  // [embed_norm(embeds), input norm(hidden)], 2D wide
        rms_norm(embeds.data_ptr<float>(), r0, r1, D, embed_norm->data_ptr<float>(), eps, x.data(), 2 * D);
        rms_norm(h, r0, r1, D, input_norm, eps, x.data() + D, 2 * D);
      } else {
        rms_norm(h, r0, r1, D, input_norm, eps, x.data());
      }
      LSSP_LAP_IF(t == 0, 0);
      multiply(linears[4 * l], x.data(), qkv.data(), [&] {  // the cache rows written next
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = live[r] / n, i = live[r] % n, size = hd * keys.element_size();
          for (int64_t g = 0; g < kv_heads; ++g) {
            prefetch_range(static_cast<const char*>(keys.data_ptr()) +
                           (b * keys.stride(0) + g * keys.stride(1) + (start + i) * keys.stride(2)) * keys.element_size(), size);
            prefetch_range(static_cast<const char*>(values.data_ptr()) +
                           (b * values.stride(0) + g * values.stride(1) + (start + i) * values.stride(2)) *
                           values.element_size(), size);
          }
        }
      });
      LSSP_LAP_IF(t == 0, 1);
      for (int64_t r = r0; r < r1; ++r) {  // rotary on queries and keys; keys and values into the cache
        const int64_t b = live[r] / n, i = live[r] % n;
        float* row = qkv.data() + r * width;
        const float* c = cos.data_ptr<float>() + b * c_batch + i * hd;
        const float* sn = sin.data_ptr<float>() + b * c_batch + i * hd;
        for (int64_t g = 0; g < heads + kv_heads; ++g) rotate(row + g * hd, c, sn, hd);
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t at_k = b * keys.stride(0) + g * keys.stride(1) + (start + i) * keys.stride(2);
          const int64_t at_v = b * values.stride(0) + g * values.stride(1) + (start + i) * values.stride(2);
          if (half) {
            put_row(row + (heads + g) * hd, keys.data_ptr<at::Half>() + at_k, hd);
            put_row(row + (heads + kv_heads + g) * hd, values.data_ptr<at::Half>() + at_v, hd);
          } else {
            put_row(row + (heads + g) * hd, keys.data_ptr<float>() + at_k, hd);
            put_row(row + (heads + kv_heads + g) * hd, values.data_ptr<float>() + at_v, hd);
          }
        }
      }
      team.sync();
      LSSP_LAP_IF(t == 0, 2);
      if (half) attend_layer<at::Half>(plan, qkv.data(), width, keys, values, scale, attn.data(), team, t, taken[l]);
      else attend_layer<float>(plan, qkv.data(), width, keys, values, scale, attn.data(), team, t, taken[l]);
      team.sync();
      LSSP_LAP_IF(t == 0, 3);
      multiply(linears[4 * l + 1], attn.data(), proj.data(), [&] { prefetch_range(w[7].data_ptr(), D * 4); });
      LSSP_LAP_IF(t == 0, 4);
      add_rows(proj.data());
      rms_norm(h, r0, r1, D, w[7].data_ptr<float>(), eps, x.data());
      LSSP_LAP_IF(t == 0, 5);
      multiply(linears[4 * l + 2], x.data(), gate_up.data(), [] {});
      LSSP_LAP_IF(t == 0, 6);
      for (int64_t r = r0; r < r1; ++r) {  // silu(gate) * up
        const float* gu = gate_up.data() + r * 2 * inner;
        float* a = act.data() + r * inner;
        for (int64_t j = 0; j < inner; j += 16) {
          const mask16 lanes = lanes_from(inner - j);
          const v16f g = v16_maskz_loadu_ps(lanes, gu + j);
          const v16f e = exp512(v16_sub_ps(v16_setzero_ps(), g));
          const v16f silu = v16_div_ps(g, v16_add_ps(v16_set1_ps(1.0f), e));
          v16_mask_storeu_ps(a + j, lanes, v16_mul_ps(silu, v16_maskz_loadu_ps(lanes, gu + inner + j)));
        }
      }
      LSSP_LAP_IF(t == 0, 7);
      multiply(linears[4 * l + 3], act.data(), proj.data(), [&] {  // the next layer's input norm
        if (l + 1 < L && w[kPerLayer].numel()) prefetch_range(w[kPerLayer].data_ptr(), D * 4);
      });
      LSSP_LAP_IF(t == 0, 8);
    }
    add_rows(proj.data());
    LSSP_LAP_IF(t == 0, 9);
    // the final norm, in place (each row's squares are summed before it is written) or apart
    if (last_norm) rms_norm(h, r0, r1, D, last_norm, eps, normed_apart ? apart.data() : h);
  });
  const float* normed = normed_apart ? apart.data() : h;  // the rows the output layer reads
  // The computed rows back in their places (B, n, D), holes zero; ``row_of``: each position's row (-1: a hole).
  std::vector<int64_t> row_of(B * n, -1);
  for (int64_t r = 0; r < R; ++r) row_of[live[r]] = r;
  at::Tensor full = hidden;
  if (holes) {
    full = at::zeros({B * n, D}, hidden.options());
    full.index_copy_(0, live_index, hidden);
    full = full.view({B, n, D});
  }
  if (output.empty()) return std::make_tuple(full, at::empty({0}, hidden.options()));
  TORCH_CHECK(output.size() == 3, "decoder: output is packed, scales, mins");
  const Blocks o = blocks_of(output[0], output[1], output[2], D);
  const int64_t kept = keep > 0 ? std::min(keep, n) : n;
  std::vector<int64_t> picked;  // the last ``kept`` positions of each row (b * kept + j) that were computed
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < kept; ++j)
      if (row_of[b * n + n - kept + j] >= 0) picked.push_back(b * kept + j);
  std::vector<float> last(picked.size() * D);
  for (size_t p = 0; p < picked.size(); ++p) {
    const int64_t b = picked[p] / kept, j = picked[p] % kept;
    const float* row = normed + row_of[b * n + n - kept + j] * D;
    std::copy(row, row + D, last.data() + p * D);
  }
  LSSP_LAP_RESET();  // the final norm and the rows' bookkeeping are in no phase
  at::Tensor logits = holes ? at::zeros({B, kept, o.N}, hidden.options()) : at::empty({B, kept, o.N}, hidden.options());
  if (!holes) {
    matmul(o, last.data(), B * kept, logits.data_ptr<float>(), s);
  } else {
    std::vector<float> computed(picked.size() * o.N);
    matmul(o, last.data(), static_cast<int64_t>(picked.size()), computed.data(), s);
    for (size_t p = 0; p < picked.size(); ++p)
      std::copy(computed.data() + p * o.N, computed.data() + (p + 1) * o.N, logits.data_ptr<float>() + picked[p] * o.N);
  }
  LSSP_LAP(10);
  return std::make_tuple(full, logits);
}

// Bits of the lanes of x that are NaN, and of those equal to t.
#if LSSP_AVX512
inline uint32_t nan_bits(v16f x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
inline uint32_t equal_bits(v16f x, float t) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_EQ_OQ); }
#else
inline uint32_t nan_bits(v16f x) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q))) << 8;
}
inline uint32_t equal_bits(v16f x, float t) {
  const __m256 v = _mm256_set1_ps(t);
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, v, _CMP_EQ_OQ))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.hi, v, _CMP_EQ_OQ))) << 8;
}
#endif

// The index of the first maximum of l (n,), a NaN counting as the maximum (NumPy's argmax): the first NaN where there
// is one. Vectors of 16: the maximum, then the first lane equal to it.
int64_t first_max(const float* l, int64_t n) {
  const int64_t whole = n / 16 * 16;
  v16f most = v16_set1_ps(-INFINITY);
  uint32_t nan = 0;
  for (int64_t c = 0; c < whole; c += 16) {
    const v16f x = v16_loadu_ps(l + c);
    nan |= nan_bits(x);
    most = v16_max_ps(most, x);
  }
  float top = v16_reduce_max_ps(most);
  for (int64_t c = whole; c < n; ++c) {
    if (std::isnan(l[c])) nan = 1;
    else top = std::max(top, l[c]);
  }
  for (int64_t c = 0; nan && c < n; ++c)
    if (std::isnan(l[c])) return c;
  for (int64_t c = 0; c < whole; c += 16)
    if (const uint32_t hits = equal_bits(v16_loadu_ps(l + c), top)) return c + __builtin_ctz(hits);
  for (int64_t c = whole; c < n; ++c)
    if (l[c] == top) return c;
  return 0;
}

// e^x in each lane, 0 where x < -87.3 (e^x below float's smallest normal): a -inf logit's probability is 0.
inline v16f exp_or_zero(v16f x) {
#if LSSP_AVX512
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), exp512(x));
#else
  const v16f e = exp512(x);
  const __m256 floor = _mm256_set1_ps(-87.3f);
  return pair(_mm256_and_ps(e.lo, _mm256_cmp_ps(x.lo, floor, _CMP_GE_OQ)),
              _mm256_and_ps(e.hi, _mm256_cmp_ps(x.hi, floor, _CMP_GE_OQ)));
#endif
}

// probs (n,) = softmax(l * inv_t): e^((l - max l) inv_t), 0 for a -inf logit, over their sum, in float32.
void softmax_row(const float* l, int64_t n, float inv_t, float* probs) {
  v16f most = v16_set1_ps(-INFINITY);
  for (int64_t c = 0; c < n; c += 16) most = v16_max_ps(most, v16_mask_loadu_ps(most, lanes_from(n - c), l + c));
  const v16f top = v16_set1_ps(v16_reduce_max_ps(most)), scale = v16_set1_ps(inv_t);
  v16f sums = v16_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const mask16 lanes = lanes_from(n - c);
    const v16f e = exp_or_zero(v16_mul_ps(v16_sub_ps(v16_maskz_loadu_ps(lanes, l + c), top), scale));
    v16_mask_storeu_ps(probs + c, lanes, e);
    sums = v16_mask_add_ps(sums, lanes, sums, e);
  }
  const v16f inv = v16_set1_ps(1.0f / v16_reduce_add_ps(sums));
  for (int64_t c = 0; c < n; c += 16) {
    const mask16 lanes = lanes_from(n - c);
    v16_mask_storeu_ps(probs + c, lanes, v16_mul_ps(v16_maskz_loadu_ps(lanes, probs + c), inv));
  }
}

// The index u (in [0, 1)) picks from weights w (n,): the first whose cumulative weight exceeds u x the total, never
// one of weight 0. w = probs, or with ``minus`` max(0, probs - minus) (speculative sampling's residual; probs where
// that leaves no mass). Sums in float64 over blocks of 256 weights (each summed in float32 lanes): the blocks before
// the point are skipped whole, the rest scanned weight by weight.
int64_t draw_index(const float* probs, const float* minus, int64_t n, double u) {
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    v16f acc = v16_setzero_ps();
    for (int64_t c = b * kBlock; c < std::min(n, (b + 1) * kBlock); c += 16) {
      const mask16 lanes = lanes_from(n - c);
      v16f w = v16_maskz_loadu_ps(lanes, probs + c);
      if (minus) w = v16_max_ps(v16_sub_ps(w, v16_maskz_loadu_ps(lanes, minus + c)), v16_setzero_ps());
      acc = v16_add_ps(acc, w);
    }
    total += (sums[b] = v16_reduce_add_ps(acc));
  }
  if (minus && !(total > 0.0)) return draw_index(probs, nullptr, n, u);  // p = q up to rounding: p itself
  const auto weight = [&](int64_t c) { return minus ? std::max(0.0f, probs[c] - minus[c]) : probs[c]; };
  const double point = u * total;
  double running = 0.0;
  int64_t b = 0;
  while (b + 1 < blocks && running + sums[b] <= point) running += sums[b++];
  int64_t last = -1;  // the last index of positive weight scanned
  for (int64_t c = b * kBlock; c < n; ++c) {
    const float w = weight(c);
    if (w > 0.0f) {
      last = c;
      if ((running += w) > point) return c;
    }
  }
  for (int64_t c = b * kBlock - 1; last < 0 && c >= 0; --c)  // rounding ran past the end: the last positive weight
    if (weight(c) > 0.0f) last = c;
  return std::max<int64_t>(last, 0);
}

// q = softmax(l / temperature) (n,) written to q, and the index u (in [0, 1)) picks from it: the rule of
// lssp.decoding.sampling's warp and inverse_cdf on a CPU.
int64_t draw(const float* l, int64_t n, double temperature, double u, float* q) {
  softmax_row(l, n, static_cast<float>(1.0 / temperature), q);
  return draw_index(q, nullptr, n, u);
}

// lssp::softmax_rows: softmax(logits / temperature) of each row of logits (R, V), in float32 (as draw computes q).
at::Tensor softmax_rows(const at::Tensor& logits_in, double temperature) {
  TORCH_CHECK(logits_in.dim() == 2 && temperature > 0, "softmax_rows: logits (R, V) and a temperature > 0");
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty_like(logits);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      softmax_row(logits.data_ptr<float>() + r * V, V, static_cast<float>(1.0 / temperature), out.data_ptr<float>() + r * V);
  });
  return out;
}

// lssp::draw_from: the index u (in [0, 1)) picks from probs (V,), or from the residual max(0, probs - minus) (draw_index).
int64_t draw_from(const at::Tensor& probs_in, const c10::optional<at::Tensor>& minus_in, double u) {
  const at::Tensor probs = probs_in.to(at::kFloat).contiguous();
  TORCH_CHECK(probs.dim() == 1 && probs.numel() > 0, "draw_from: probs (V,)");
  at::Tensor minus;
  if (minus_in.has_value() && minus_in->defined()) {
    minus = minus_in->to(at::kFloat).contiguous();
    TORCH_CHECK(minus.sizes() == probs.sizes(), "draw_from: minus (V,) as probs");
  }
  return draw_index(probs.data_ptr<float>(), minus.defined() ? minus.data_ptr<float>() : nullptr, probs.numel(), u);
}

// lssp::verify_greedy: greedy verification (lssp.decoding.verification.greedy_verification) in one call: drafts
// (k,) pass while each is the first maximum of its row of logits (k + 1, V); returns (drafts passed n, the first
// maximum of row n). Rows past n are not read.
std::tuple<int64_t, int64_t> verify_greedy(const at::Tensor& logits_in, const at::Tensor& drafts_in) {
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const at::Tensor drafts = drafts_in.to(at::kLong).contiguous();
  const int64_t k = drafts.numel(), V = logits.size(-1);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == k + 1 && V > 0, "verify_greedy: logits (k + 1, V), drafts (k,)");
  for (int64_t n = 0;; ++n) {
    const int64_t best = first_max(logits.data_ptr<float>() + n * V, V);
    if (n == k || best != drafts.data_ptr<int64_t>()[n]) return std::make_tuple(n, best);
  }
}

// lssp::verify_sampled: sampled verification at a temperature (lssp.decoding.verification.sampled_verification of
// softmax_rows(logits, temperature)) in one call: draft i of drafts (k,) passes where accept_u[i] x q[i, draft] <
// p[i, draft] (in float64), p = softmax(logits / temperature) (k + 1, V) row by row as softmax_rows computes it, q the
// draft's (k, V); the first rejection's token is drawn by next_u from max(0, p - q) of its row, a full acceptance's
// from p's last row (draw_index). Returns (drafts passed n, the token). Rows past n are not read.
std::tuple<int64_t, int64_t> verify_sampled(const at::Tensor& logits_in, const at::Tensor& q_in,
                                            const at::Tensor& drafts_in, const at::Tensor& accept_u_in, double next_u,
                                            double temperature) {
  const at::Tensor logits = logits_in.to(at::kFloat).contiguous();
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor drafts = drafts_in.to(at::kLong).contiguous();
  const at::Tensor accept_u = accept_u_in.to(at::kFloat).contiguous();
  const int64_t k = drafts.numel(), V = logits.size(-1);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == k + 1 && V > 0 &&
              (k == 0 || (q.dim() == 2 && q.size(0) == k && q.size(1) == V)) && accept_u.numel() == k && temperature > 0,
              "verify_sampled: logits (k + 1, V), q (k, V), drafts (k,), accept_u (k,), a temperature > 0");
  std::vector<float> p(V);
  for (int64_t n = 0;; ++n) {
    softmax_row(logits.data_ptr<float>() + n * V, V, static_cast<float>(1.0 / temperature), p.data());
    if (n == k) return std::make_tuple(n, draw_index(p.data(), nullptr, V, next_u));
    const int64_t draft = drafts.data_ptr<int64_t>()[n];
    TORCH_CHECK(draft >= 0 && draft < V, "verify_sampled: a draft out of the vocabulary");
    const float* q_row = q.data_ptr<float>() + n * V;
    const double u = accept_u.data_ptr<float>()[n];
    if (!(u * static_cast<double>(q_row[draft]) < static_cast<double>(p[draft])))
      return std::make_tuple(n, draw_index(p.data(), q_row, V, next_u));
  }
}

// lssp::draft_chain: a feature head's k drafts in one call, without Python between its steps. ids (n,): the
// tokens the head has not read, features (n, D) float32 the features paired with them (the target's, or the head's
// last guess). Each step multiplies [the tokens' rows of table (V, D) float32, their features] by fc (packed, scales,
// mins: D outputs of 2D inputs), runs the head's layers (weights, cache as for decoder) at slots from start and its
// output rows (output) over the last position; the draft is token_ids[the first maximum of those logits] (NaN counting
// as the maximum, as NumPy's argmax), and the next step feeds it with the last hidden state as its feature. The steps
// are those of a forward per draft through decoder: the same drafts, the same cache. cos, sin (1, n + k - 1, hd): the
// rotary embedding of slots start..start+n+k-2. With temperature > 0 each draft is drawn instead: q = softmax(logits /
// temperature) in float32, and the draft is token_ids[the first row whose cumulative q (summed in float64) exceeds
// uniforms[j] x the total] (uniforms (k,) float64, in [0, 1)): the rule of lssp.decoding.sampling.inverse_cdf. Returns
// the drafts (k,), the last step's hidden state (1, 1, D), its logits (N,) and each step's q (k, N; empty when greedy):
// with k = 1, one drafting step whose draft the caller may pick otherwise (a hint, top-k, top-p).
// An EAGLE-3 head (fc empty, embed_norm and final_norm given): the features are the head's states already (fused by
// its fc where the target's), each step runs decoder's EAGLE-3 layer over [embedding, state] (see decoder), its
// logits after final_norm, and the next step reads the state before it.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_chain(const at::Tensor& ids_in, const at::Tensor& table,
                                               const at::Tensor& features_in, at::TensorList fc, const at::Tensor& cos,
                                               const at::Tensor& sin, at::TensorList weights, at::TensorList cache,
                                               int64_t start, int64_t heads, int64_t kv_heads, double eps, double scale,
                                               at::TensorList output, const at::Tensor& token_ids_in, int64_t k,
                                               double temperature, const c10::optional<at::Tensor>& uniforms_in,
                                               const c10::optional<at::Tensor>& embed_norm,
                                               const c10::optional<at::Tensor>& final_norm) {
  const int64_t D = table.size(1), n = ids_in.numel();
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous(), "draft_chain: table (V, D) float32");
  TORCH_CHECK(k >= 1 && n >= 1 && features_in.numel() == n * D, "draft_chain: k >= 1, ids (n,), features (n, D)");
  const bool eagle3 = fc.empty();
  TORCH_CHECK((fc.size() == 3 || (eagle3 && embed_norm.has_value() && final_norm.has_value())) && output.size() == 3,
              "draft_chain: fc (or an EAGLE-3 head's embed_norm and final_norm) and output are packed, scales, mins");
  TORCH_CHECK(cos.dim() == 3 && cos.size(1) >= n + k - 1, "draft_chain: cos, sin (1, n + k - 1, head_dim)");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor features = features_in.to(at::kFloat).contiguous();
  const at::Tensor token_ids = token_ids_in.to(at::kLong).contiguous();
  const Blocks f = eagle3 ? Blocks{} : blocks_of(fc[0], fc[1], fc[2], 2 * D);
  TORCH_CHECK(eagle3 || f.N == D, "draft_chain: fc maps 2D inputs to D");
  const int64_t V = table.size(0), N = output[0].size(0);
  TORCH_CHECK(token_ids.numel() == N, "draft_chain: a vocabulary id per output row");
  std::vector<float> x(n * 2 * D);  // [embedding, feature] of each position fed
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(id >= 0 && id < V, "draft_chain: token id out of the table");
    std::copy(table.data_ptr<float>() + id * D, table.data_ptr<float>() + (id + 1) * D, x.data() + i * 2 * D);
    std::copy(features.data_ptr<float>() + i * D, features.data_ptr<float>() + (i + 1) * D, x.data() + i * 2 * D + D);
  }
  const bool sampled = temperature > 0;
  at::Tensor uniforms;
  if (sampled) {
    TORCH_CHECK(uniforms_in.has_value() && uniforms_in->numel() == k, "draft_chain: sampling takes k uniforms");
    uniforms = uniforms_in->to(at::kDouble).contiguous();
  }
  at::Tensor drafts = at::empty({k}, at::TensorOptions().dtype(at::kLong));
  at::Tensor q = at::empty({sampled ? k : 0, N}, table.options());
  at::Tensor guess, last;
  Scratch s;
  for (int64_t j = 0, slot = start, count = n; j < k; ++j, slot += count, count = 1) {
    at::Tensor hidden, embeds;
    if (eagle3) {  // x's rows are [embedding, state]
      const at::Tensor rows = at::from_blob(x.data(), {1, count, 2 * D}, table.options());
      embeds = rows.narrow(2, 0, D).contiguous();
      hidden = rows.narrow(2, D, D).contiguous();
    } else {
      hidden = at::empty({1, count, D}, table.options());
      matmul(f, x.data(), count, hidden.data_ptr<float>(), s);
    }
    const at::Tensor step_cos = cos.narrow(1, slot - start, count), step_sin = sin.narrow(1, slot - start, count);
    auto [h, logits] = decoder(hidden, step_cos, step_sin, c10::nullopt, weights, cache, slot, heads, kv_heads, eps,
                               scale, eagle3 ? final_norm : c10::nullopt, output, 1, c10::nullopt,
                               eagle3 ? c10::optional<at::Tensor>(embeds) : c10::nullopt, embed_norm, -1, 0,
                               c10::nullopt, -1);
    last = logits;
    const float* l = logits.data_ptr<float>();
    const int64_t best = sampled ? draw(l, N, temperature, uniforms.data_ptr<double>()[j], q.data_ptr<float>() + j * N)
                                 : first_max(l, N);
    const int64_t token = token_ids.data_ptr<int64_t>()[best];
    drafts.data_ptr<int64_t>()[j] = token;
    guess = h.narrow(1, count - 1, 1).contiguous();
    if (j + 1 < k) {
      TORCH_CHECK(token >= 0 && token < V, "draft_chain: a drafted id out of the table");
      x.resize(2 * D);
      std::copy(table.data_ptr<float>() + token * D, table.data_ptr<float>() + (token + 1) * D, x.data());
      std::copy(guess.data_ptr<float>(), guess.data_ptr<float>() + D, x.data() + D);
    }
  }
  return std::make_tuple(drafts, guess, last.reshape({N}), q);
}

// lssp::arena: nbytes of uint8 in memory aligned to 2 MiB and advised as huge pages (the weights a forward streams:
// one TLB entry per 2 MiB instead of per 4 KiB), touched now so that the pages are made huge as they fault in. The
// memory comes straight from mmap: memory malloc hands back (what loading the model freed) is already faulted in as
// 4 KiB pages, which advice no longer changes (a forward then took up to 20% longer, per process, by chance).
at::Tensor arena(int64_t nbytes) {
  constexpr size_t kHuge = 2u << 20;
  const size_t size = (static_cast<size_t>(std::max<int64_t>(nbytes, 1)) + kHuge - 1) / kHuge * kHuge;
  void* raw = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "arena: cannot map ", size, " bytes");
  const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge;
  const size_t before = start - reinterpret_cast<uintptr_t>(raw);
  if (before) munmap(raw, before);  // the slack on either side of the aligned span
  if (kHuge - before) munmap(reinterpret_cast<void*>(start + size), kHuge - before);
  void* memory = reinterpret_cast<void*>(start);
  madvise(memory, size, MADV_HUGEPAGE);  // a hint: where the kernel refuses it, plain pages serve
  std::memset(memory, 0, size);
  return at::from_blob(memory, {nbytes}, [size](void* p) { munmap(p, size); }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

TORCH_LIBRARY(lssp, m) {
  m.def("block_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("row_attention(Tensor q, Tensor keys, Tensor values, Tensor? allowed, float scale) -> Tensor");
  m.def("arena(int nbytes) -> Tensor");
  m.def("softmax_rows(Tensor logits, float temperature) -> Tensor");
  m.def("draw_from(Tensor probs, Tensor? minus, float u) -> int");
  m.def("verify_greedy(Tensor logits, Tensor drafts) -> (int, int)");
  m.def("verify_sampled(Tensor logits, Tensor q, Tensor drafts, Tensor accept_u, float next_u, float temperature) "
        "-> (int, int)");
  m.def("decoder(Tensor hidden, Tensor cos, Tensor sin, Tensor? allowed, Tensor[] weights, Tensor(a!)[] cache, "
        "int start, int heads, int kv_heads, float eps, float scale, Tensor? final_norm, Tensor[] output, int keep, "
        "Tensor? used=None, Tensor? embeds=None, Tensor? embed_norm=None, int stack=-1, int stack_layer=0, "
        "Tensor? ids=None, int rope_start=-1) -> (Tensor, Tensor)");
  m.def("keep(Tensor[] tensors) -> int");
  m.def("release(int handle) -> ()");
  m.def("kept(int handle) -> Tensor[]");
  m.def("draft_chain(Tensor ids, Tensor table, Tensor features, Tensor[] fc, Tensor cos, Tensor sin, Tensor[] weights, "
        "Tensor(a!)[] cache, int start, int heads, int kv_heads, float eps, float scale, Tensor[] output, "
        "Tensor token_ids, int k, float temperature=0., Tensor? uniforms=None, Tensor? embed_norm=None, "
        "Tensor? final_norm=None) -> (Tensor, Tensor, Tensor, Tensor)");
#ifdef LSSP_PHASES
  m.def("phase_times() -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(lssp, CPU, m) {
  m.impl("block_mm", &block_mm);
  m.impl("row_attention", &row_attention);
  m.impl("decoder", &decoder);
  m.impl("draft_chain", &draft_chain);
  m.impl("softmax_rows", &softmax_rows);
  m.impl("draw_from", &draw_from);
  m.impl("verify_greedy", &verify_greedy);
  m.impl("verify_sampled", &verify_sampled);
}

TORCH_LIBRARY_IMPL(lssp, CompositeExplicitAutograd, m) {
  m.impl("arena", &arena);
  m.impl("keep", &keep);
  m.impl("release", &release);
  m.impl("kept", &kept_tensors);
#ifdef LSSP_PHASES
  m.impl("phase_times", &phase_times);
#endif
}
