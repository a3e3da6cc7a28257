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

// `Cols` output columns from `col` on, for `Rows` activation rows (x as float32); both counts
// are template arguments so that the Rows x Cols accumulators are registers. Per block: each
// column's 32 weights dequantized into registers once, then multiplied with every row.
template <int64_t Rows, int64_t Cols, typename Weight, typename Out>
void gemv_tile(const Weight weight, const float* x, Out* out, int64_t n, int64_t col) {
  const int64_t k = weight.k;
  Vec acc[Rows][Cols];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) acc[r][c] = Vec(0.0f);
  for (int64_t g = 0, b = 0; g < weight.groups; ++g) {
    decltype(weight.group(0, 0)) group[Cols];
    for (int64_t c = 0; c < Cols; ++c) group[c] = weight.group(col + c, g);
    for (const int64_t group_end = b + weight.blocks_per_group; b < group_end; ++b) {
      Vec w[Cols][kBlockVecs];
      for (int64_t c = 0; c < Cols; ++c) weight.dequantize(col + c, b, group[c], w[c]);
      for (int64_t r = 0; r < Rows; ++r)
        for (int64_t v = 0; v < kBlockVecs; ++v) {
          const Vec xv = Vec::loadu(x + r * k + b * kBlock + v * Vec::size());
          for (int64_t c = 0; c < Cols; ++c) acc[r][c] = at::vec::fmadd(w[c][v], xv, acc[r][c]);
        }
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c)
      out[r * n + col + c] = static_cast<Out>(weight.output_scale(col + c) *
                                              at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[r][c]));
}

// Threads take whole output columns; a grain of 16 columns keeps each thread on a long run of
// the weight, read once, front to back.
template <typename Weight>
void gemv(at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t n) {
  const at::Tensor values = x.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemv", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      with_row_count(x.size(0), [&](auto rows_) {
        for_column_tiles<decltype(rows_)::value>(begin, end, [&](auto cols_, int64_t col) {
          gemv_tile<decltype(rows_)::value, decltype(cols_)::value>(weight, values.data_ptr<float>(), dst, n,
                                                                    col);
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
          const auto group = weight.group(row_begin + row, b / weight.blocks_per_group);
          const Vec row_scale(weight.output_scale(row_begin + row));
          Vec w[kBlockVecs];
          weight.dequantize(row_begin + row, b, group, w);
          float values[kBlock];
          for (int64_t v = 0; v < kBlockVecs; ++v) (w[v] * row_scale).store(values + v * Vec::size());
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
