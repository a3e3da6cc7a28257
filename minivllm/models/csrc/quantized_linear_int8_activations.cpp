// Chapter 12, "Floats or integers on the other side": the products of `quantized_linear.cpp` with the
// activations quantized too (W4A8, W8A8), as llama.cpp multiplies its Q4_1 weights by Q8_1
// activations. Registered as torch.ops.minivllm_cpu.*:
//
//   w4a8_gemv(out, x, packed, scale, minimum)   int4 weights, int8 activations, few rows
//   w8a8_gemv(out, x, q, scale)                 int8 weights, int8 activations
//
// Each activation row is cut into blocks of 32 values; a block is stored as int8 xq with one
// step, x ~ xq * step, step = max|x| / 127 (a block below the smallest normal float32 is all
// zeros). The product of a weight block with an activation block is then one integer dot product
// of 32 byte pairs (AVX512-VNNI's vpdpbusd where the CPU has it, AVX2's vpmaddubsw otherwise),
// scaled once by the weight's scale times the block's step: four times the multiplies of a float
// vector instruction, from a quarter of the bytes. The price is the activations' rounding, about
// 0.4% of a block's largest value; the W4A16 product of `quantized_linear.cpp` has none.
#include <torch/library.h>

#include <cfloat>
#include <cmath>
#include <vector>

#include "quantized_blocks.h"

namespace {

using namespace minivllm_quantized;  // the blocks of quantized_blocks.h

// Activation rows as int8 blocks: values, each block's step, and each block's step * sum(xq),
// which an int4 group's minimum multiplies (the minimum's share of the block's dot product).
struct Int8Rows {
  std::vector<int8_t> q;     // [rows, K]
  std::vector<float> steps;  // [rows, K / 32]
  std::vector<float> sums;   // [rows, K / 32]
};

// x [rows, K] float32 -> int8 blocks, rounding to the nearest level (ties to even, as
// torch.round), the definition `quantize_activation_blocks` in cpu_quantized.py writes out.
Int8Rows quantize_rows(const at::Tensor& x) {
  const int64_t blocks = x.numel() / kBlock;
  Int8Rows rows{std::vector<int8_t>(x.numel()), std::vector<float>(blocks), std::vector<float>(blocks)};
  const float* values = x.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = values + b * kBlock;
    float largest = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) largest = std::max(largest, std::abs(v[j]));
    if (largest < FLT_MIN) continue;  // zeros, step 0
    const float inverse = 127.0f / largest;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int8_t level = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
      rows.q[b * kBlock + j] = level;
      sum += level;
    }
    rows.steps[b] = largest / 127.0f;
    rows.sums[b] = rows.steps[b] * static_cast<float>(sum);
  }
  return rows;
}

#ifdef MINIVLLM_INTEGER_BLOCKS
// Sums of four neighbouring products of unsigned and signed bytes: 8 int32 lanes for 32 pairs.
inline __m256i dot_bytes(__m256i unsigned_bytes, __m256i signed_bytes) {
#if defined(MINIVLLM_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned_bytes, signed_bytes);
#else  // pairs into int16 (at most 2 * 127 * 127, no overflow), then pairs of those into int32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, signed_bytes), _mm256_set1_epi16(1));
#endif
}

// int4 integers are unsigned already; signed int8 weights lend their sign to the activations
// (|w| * (x * sign(w)) = w * x), so that the instruction's unsigned side is |w|.
template <typename Scale>
inline __m256i dot_block(const Int4Weight<Scale>&, __m256i weight, __m256i x) { return dot_bytes(weight, x); }
inline __m256i dot_block(const Int8Weight&, __m256i weight, __m256i x) {
  return dot_bytes(_mm256_sign_epi8(weight, weight), _mm256_sign_epi8(x, weight));
}

inline float sum_lanes(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// `Cols` output columns from `col` on, for `Rows` rows (see gemv_tile in quantized_linear.cpp):
// per block, each column's weight bytes read once, then for every row one integer dot product,
// converted and scaled by scale * step into a float accumulator, and the minimum's term added.
template <int64_t Rows, int64_t Cols, typename Weight, typename Out>
void integer_tile(const Weight weight, const int8_t* xq, const float* steps, const float* sums,
                  Out* out, int64_t n, int64_t col) {
  const int64_t k = weight.k, blocks = k / kBlock;
  __m256 acc[Rows][Cols];
  float minimum_terms[Rows][Cols] = {};
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < weight.groups; ++g) {
    float scale[Cols], minimum[Cols];
    for (int64_t c = 0; c < Cols; ++c) scale[c] = weight.scale(col + c, g), minimum[c] = weight.minimum(col + c, g);
    for (const int64_t group_end = b + weight.blocks_per_group; b < group_end; ++b) {
      __m256i w[Cols];
      for (int64_t c = 0; c < Cols; ++c) w[c] = weight.bytes(col + c, b);
      for (int64_t r = 0; r < Rows; ++r) {
        const __m256i x = int8_block_bytes(xq + r * k + b * kBlock);
        const float step = steps[r * blocks + b], sum = sums[r * blocks + b];
        for (int64_t c = 0; c < Cols; ++c) {
          const __m256 dot = _mm256_cvtepi32_ps(dot_block(weight, w[c], x));
          acc[r][c] = _mm256_fmadd_ps(dot, _mm256_set1_ps(scale[c] * step), acc[r][c]);
          minimum_terms[r][c] += minimum[c] * sum;
        }
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c)
      out[r * n + col + c] = static_cast<Out>(sum_lanes(acc[r][c]) + minimum_terms[r][c]);
}
#endif

template <typename Weight>
void integer_gemv(at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t n) {
#ifdef MINIVLLM_INTEGER_BLOCKS
  const Int8Rows rows = quantize_rows(x.to(at::kFloat).contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "integer_gemv", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      with_row_count(x.size(0), [&](auto rows_) {
        for_column_tiles<decltype(rows_)::value>(weight, begin, end, [&](auto cols_, int64_t col) {
          integer_tile<decltype(rows_)::value, decltype(cols_)::value>(
              weight, rows.q.data(), rows.steps.data(), rows.sums.data(), dst, n, col);
        });
      });
    });
  });
#else
  TORCH_CHECK(false, "int8 activations need AVX2 or AVX-512 integer dot products; this build has neither");
#endif
}

}  // namespace

namespace minivllm_quantized {

void w4a8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum) {
  with_int4_weight(out, x, packed, scale, minimum, [&](const auto& weight) { integer_gemv(out, x, weight, packed.size(0)); });
}

void w8a8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  with_int8_weight(out, x, q, scale, [&](const auto& weight) { integer_gemv(out, x, weight, q.size(0)); });
}

}  // namespace minivllm_quantized

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("w4a8_gemv(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> ()");
  m.def("w8a8_gemv(Tensor(a!) out, Tensor x, Tensor q, Tensor scale) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("w4a8_gemv", &w4a8_gemv);
  m.impl("w8a8_gemv", &w8a8_gemv);
}
