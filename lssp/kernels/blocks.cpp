// lssp::block_mm: y = x W^T for a weight W in groups of 32 inputs, w = q * d + m, with q unsigned 4-bit (0..15: a
// GGUF's Q4_1 blocks) or 8-bit (0..255: a Q8_0 block's q + 128, with m = -128 d), and activations quantized to int8
// in groups of 32 (s = max|x| / 127) as llama.cpp quantizes them (Q8_1):
//   y[r, n] = sum_g d[n, g] s[r, g] sum_k q[n, k] xq[r, k]  +  m[n, g] s[r, g] sum_k xq[r, k]
// The integer dot products run on AVX512-VNNI (vpdpbusd: unsigned weights by signed int8 activations, 4 per lane).
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
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;
constexpr int64_t kAhead = 2048;  // bytes of weights prefetched ahead of those multiplied (measured on an AMD EPYC)

// Activations in int8 groups: xq (R, K), each group's scale s, and s * sum(xq) for the minimum's term.
void quantize_rows(const float* x, int64_t R, int64_t K, int8_t* xq, float* row_scales, float* group_sums) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* v = x + r * K + g * kGroup;
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v));
      const __m512 b = _mm512_abs_ps(_mm512_loadu_ps(v + 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
      const float s = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t total = 0;
      int8_t* q = xq + r * K + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        q[i] = static_cast<int8_t>(qi);
        total += qi;
      }
      row_scales[r * G + g] = s;
      group_sums[r * G + g] = s * static_cast<float>(total);
    }
  }
}

// Rows r0..r0+T-1 of the output for the blocks of 16 weight rows nb0..nb1-1. Each 32-bit lane of a vector is one
// weight row: vpdpbusd adds 4 of its products to it, so no horizontal sums are needed.
template <int T, int Bits>
void tile(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const int8_t* xq, const float* row_scales,
          const float* group_sums, float* y, int64_t r0, int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  constexpr int kChunks = Bits;  // 64-byte loads per group of 32 inputs of 16 rows (16 * 32 * Bits / 8 bytes)
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint8_t* w = packed + nb * 16 * (K * Bits / 8);
    const at::Half* d = scales + nb * 16 * G;
    const at::Half* m = mins + nb * 16 * G;
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512i dot[T][2];
      for (int t = 0; t < T; ++t) dot[t][0] = dot[t][1] = _mm512_setzero_si512();
      for (int c = 0; c < kChunks; ++c) {
        const uint8_t* at = w + (g * kChunks + c) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(at);
        for (int t = 0; t < T; ++t) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xq + (r0 + t) * K + g * kGroup + c * (32 / kChunks));
          if constexpr (Bits == 4) {
            const __m512i lo = _mm512_and_si512(raw, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], lo, _mm512_set1_epi32(x4[0]));
            dot[t][1] = _mm512_dpbusd_epi32(dot[t][1], hi, _mm512_set1_epi32(x4[1]));
          } else {
            dot[t][c % 2] = _mm512_dpbusd_epi32(dot[t][c % 2], raw, _mm512_set1_epi32(x4[0]));
          }
        }
      }
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * 16)));
      for (int t = 0; t < T; ++t) {
        const int64_t r = r0 + t;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[t][0], dot[t][1]));
        acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dv, _mm512_set1_ps(row_scales[r * G + g])), acc[t]);
        acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(group_sums[r * G + g]), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + t) * N + nb * 16, acc[t]);
  }
}

template <int Bits>
void rows(const uint8_t* wp, const at::Half* sp, const at::Half* mp, const int8_t* xp, const float* rs,
          const float* gs, float* yp, int64_t R, int64_t nb0, int64_t nb1, int64_t K, int64_t N) {
  int64_t r = 0;
  for (; r + kRowTile <= R; r += kRowTile) tile<kRowTile, Bits>(wp, sp, mp, xp, rs, gs, yp, r, nb0, nb1, K, N);
  for (; r + 2 <= R; r += 2) tile<2, Bits>(wp, sp, mp, xp, rs, gs, yp, r, nb0, nb1, K, N);
  for (; r < R; ++r) tile<1, Bits>(wp, sp, mp, xp, rs, gs, yp, r, nb0, nb1, K, N);
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 2, "block_mm takes x (R, K) and packed (N, K * bits / 8)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t R = x.size(0), K = x.size(1), N = packed.size(0);
  const int bits = packed.size(1) == K ? 8 : 4;
  TORCH_CHECK(K % kGroup == 0 && N % 16 == 0 && (packed.size(1) == K || packed.size(1) == K / 2),
              "block_mm: K a multiple of 32, N of 16, packed (N, K/2) or (N, K)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              "block_mm: packed uint8, scales and mins float16");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "block_mm: contiguous weights");
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  at::Tensor xq = at::empty({R, K}, x.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({R, K / kGroup}, x.options());
  at::Tensor group_sums = at::empty({R, K / kGroup}, x.options());
  quantize_rows(x.data_ptr<float>(), R, K, xq.data_ptr<int8_t>(), row_scales.data_ptr<float>(),
                group_sums.data_ptr<float>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  const int8_t* xp = xq.data_ptr<int8_t>();
  const float* rs = row_scales.data_ptr<float>();
  const float* gs = group_sums.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / 16;
  const int64_t grain = std::max<int64_t>(1, blocks / (4 * at::get_num_threads()));
  at::parallel_for(0, blocks, grain, [&](int64_t nb0, int64_t nb1) {
    if (bits == 4) rows<4>(wp, sp, mp, xp, rs, gs, yp, R, nb0, nb1, K, N);
    else rows<8>(wp, sp, mp, xp, rs, gs, yp, R, nb0, nb1, K, N);
  });
  return y;
}

inline __mmask16 lanes_from(int64_t left) {  // the first min(left, 16) lanes
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
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
  at::Tensor allowed;
  if (allowed_in.has_value()) {
    allowed = allowed_in->to(at::kBool).contiguous();
    TORCH_CHECK(allowed.dim() == 3 && (allowed.size(0) == B || allowed.size(0) == 1) && allowed.size(1) == R &&
                allowed.size(2) == S, "row_attention: allowed (B or 1, R, S)");
  }
  const bool* ap = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  const int64_t a_batch = allowed.defined() && allowed.size(0) == B ? R * S : 0;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t kb = keys.stride(0), kh = keys.stride(1), ks = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vs = values.stride(2);
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S);
    std::vector<int64_t> slots(S);
    for (int64_t bhr = begin; bhr < end; ++bhr) {
      const int64_t b = bhr / (H * R), h = (bhr / R) % H, r = bhr % R;
      const bool* sees = ap ? ap + b * a_batch + r * S : nullptr;
      const float* qr = qp + bhr * D;
      const float* kr = kp + b * kb + h * kh;
      const float* vr = vp + b * vb + h * vh;
      int64_t count = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        if (sees && !sees[j]) continue;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 lanes = lanes_from(D - d);
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, qr + d), _mm512_maskz_loadu_ps(lanes, kr + j * ks + d), acc);
        }
        scores[count] = _mm512_reduce_add_ps(acc) * sc;
        slots[count] = j;
        top = std::max(top, scores[count]);
        ++count;
      }
      float total = 0.0f;
      for (int64_t c = 0; c < count; ++c) {
        scores[c] = std::exp(scores[c] - top);
        total += scores[c];
      }
      const float inv = count ? 1.0f / total : 0.0f;
      float* o = op + bhr * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 lanes = lanes_from(D - d);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < count; ++c)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[c]), _mm512_maskz_loadu_ps(lanes, vr + slots[c] * vs + d), acc);
        _mm512_mask_storeu_ps(o + d, lanes, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
      }
    }
  });
  return out.to(q_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY(lssp, m) {
  m.def("block_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("row_attention(Tensor q, Tensor keys, Tensor values, Tensor? allowed, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lssp, CPU, m) {
  m.impl("block_mm", &block_mm);
  m.impl("row_attention", &row_attention);
}
