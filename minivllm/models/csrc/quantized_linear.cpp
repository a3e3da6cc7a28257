// Chapter 12, "Our own kernel": weight-only products that read the small integers and never
// write a float copy of the weight. Built at first use with chapter 06's CPU attention kernel
// (`minivllm/cpu_kernels.py`: one library, one cache). Registered as torch.ops.minivllm_cpu.*:
//
//   int4_gemv(out, x, packed, scale, minimum)   out[r, n] = sum_k x[r, k] * w[n, k], few rows
//   int8_gemv(out, x, q, scale)                 the same for int8 weights
//   int4_dequantize(out, packed, scale, minimum, row_begin)   rows of w, for a tiled product
//   int8_dequantize(out, q, scale, row_begin)
//
// int4 weights are packed as llama.cpp's Q4_1 blocks are: 32 weights of a row in 16 bytes, byte
// j holding weight j in its low nibble and weight j + 16 in its high one; each group of
// `group_size` weights (a multiple of 32) has a scale and a minimum, w = q * scale + minimum.
// int8 weights are w = q * scale[n]. Activations are float32, bfloat16 or float16, products are
// summed in float32 (W4A16 and W8A16: the activations are not quantized).
#include <torch/library.h>

#include <vector>

#include "quantized_blocks.h"

namespace {

using namespace minivllm_quantized;  // the blocks of quantized_blocks.h

// The activations as float32 rows, and each row's sum over every 32-weight block: the minimum of
// an int4 group multiplies the sum of the activations it meets, once per block, not per weight.
struct FloatRows {
  at::Tensor values;  // [rows, K] float32
  std::vector<float> block_sums;  // [rows, K / 32]
};

FloatRows as_float_rows(const at::Tensor& x) {
  FloatRows rows{x.to(at::kFloat).contiguous(), {}};
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  rows.block_sums.resize(m * blocks);
  const float* values = rows.values.data_ptr<float>();
  for (int64_t i = 0; i < m * blocks; ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) sum += values[i * kBlock + j];
    rows.block_sums[i] = sum;
  }
  return rows;
}

// `Cols` output columns from `col` on, for `Rows` activation rows; both counts are template
// arguments so that the Rows x Cols accumulators are registers. Per block: each column's weights
// widened once, then for every row the block's dot product with its integers, scaled once by the
// group's scale (the sum of x * (q * scale + minimum) is scale * sum(x * q) + minimum * sum(x)).
template <int64_t Rows, int64_t Cols, typename Weight, typename Out>
void gemv_tile(const Weight weight, const float* values, const float* block_sums, Out* out,
               int64_t n, int64_t col) {
  const int64_t k = weight.k, blocks = k / kBlock;
  Vec acc[Rows][Cols];
  float minimum_terms[Rows][Cols] = {};
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) acc[r][c] = Vec(0.0f);
  for (int64_t g = 0, b = 0; g < weight.groups; ++g) {
    Vec scale[Cols];
    float minimum[Cols];
    for (int64_t c = 0; c < Cols; ++c)
      scale[c] = Vec(weight.scale(col + c, g)), minimum[c] = weight.minimum(col + c, g);
    for (const int64_t group_end = b + weight.blocks_per_group; b < group_end; ++b) {
      Vec q[Cols][kBlockVecs];
      for (int64_t c = 0; c < Cols; ++c) weight.widen(col + c, b, q[c]);
      for (int64_t r = 0; r < Rows; ++r) {
        Vec xr[kBlockVecs];
        for (int64_t v = 0; v < kBlockVecs; ++v) xr[v] = Vec::loadu(values + r * k + b * kBlock + v * Vec::size());
        for (int64_t c = 0; c < Cols; ++c) {
          Vec dot = q[c][0] * xr[0];
          for (int64_t v = 1; v < kBlockVecs; ++v) dot = at::vec::fmadd(q[c][v], xr[v], dot);
          acc[r][c] = at::vec::fmadd(dot, scale[c], acc[r][c]);
          minimum_terms[r][c] += minimum[c] * block_sums[r * blocks + b];
        }
      }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c)
      out[r * n + col + c] = static_cast<Out>(
          at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[r][c]) + minimum_terms[r][c]);
}

// Threads take whole output columns; a grain of 16 columns keeps each thread on a long run of
// the weight, read once, front to back.
template <typename Weight>
void gemv(at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t n) {
  const FloatRows rows = as_float_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemv", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      with_row_count(x.size(0), [&](auto rows_) {
        for_column_tiles<decltype(rows_)::value>(begin, end, [&](auto cols_, int64_t col) {
          gemv_tile<decltype(rows_)::value, decltype(cols_)::value>(
              weight, rows.values.data_ptr<float>(), rows.block_sums.data(), dst, n, col);
        });
      });
    });
  });
}

void int4_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum) {
  with_int4_weight(out, x, packed, scale, minimum, [&](const auto& weight) { gemv(out, x, weight, packed.size(0)); });
}

void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  with_int8_weight(out, x, q, scale, [&](const auto& weight) { gemv(out, x, weight, q.size(0)); });
}

// Rows [row_begin, row_begin + out.size(0)) of the float weight, in out's dtype: a tile that a
// matrix product of many activation rows then reads from the cache (see `tiled_linear`).
template <typename Weight>
void dequantize(at::Tensor& out, const Weight& weight, int64_t row_begin, int64_t n) {
  TORCH_CHECK(out.dim() == 2 && out.size(1) == weight.k && out.is_contiguous() &&
                  at::isFloatingType(out.scalar_type()), "out must be a contiguous floating tile [rows, K]");
  TORCH_CHECK(weight.k % kBlock == 0, "K must be a multiple of ", kBlock);
  TORCH_CHECK(row_begin >= 0 && row_begin + out.size(0) <= n, "rows [", row_begin, ", ",
              row_begin + out.size(0), ") are not in the weight's ", n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, out.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        for (int64_t b = 0; b < weight.k / kBlock; ++b) {
          Vec q[kBlockVecs];
          weight.widen(row_begin + row, b, q);
          const int64_t group = b / weight.blocks_per_group;
          const Vec scale(weight.scale(row_begin + row, group)), minimum(weight.minimum(row_begin + row, group));
          float values[kBlock];
          for (int64_t v = 0; v < kBlockVecs; ++v) at::vec::fmadd(q[v], scale, minimum).store(values + v * Vec::size());
          for (int64_t j = 0; j < kBlock; ++j) dst[row * weight.k + b * kBlock + j] = static_cast<scalar_t>(values[j]);
        }
    });
  });
}

void int4_dequantize(at::Tensor out, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& minimum, int64_t row_begin) {
  DISPATCH_SCALE_TYPES(scale.scalar_type(), "int4_dequantize", [&] {
    dequantize(out, int4_weight<scalar_t>(packed, scale, minimum), row_begin, packed.size(0));
  });
}

void int8_dequantize(at::Tensor out, const at::Tensor& q, const at::Tensor& scale, int64_t row_begin) {
  dequantize(out, int8_weight(q, scale), row_begin, q.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("int4_gemv(Tensor(a!) out, Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> ()");
  m.def("int8_gemv(Tensor(a!) out, Tensor x, Tensor q, Tensor scale) -> ()");
  m.def("int4_dequantize(Tensor(a!) out, Tensor packed, Tensor scale, Tensor minimum, int row_begin) -> ()");
  m.def("int8_dequantize(Tensor(a!) out, Tensor q, Tensor scale, int row_begin) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
