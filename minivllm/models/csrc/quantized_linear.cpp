// Chapter 12, "Our own kernel": weight-only products that read the small integers and never
// write a float copy of the weight. Built at first use with chapter 06's CPU attention kernel
// (`minivllm/cpu_kernels.py`: one library, one cache). The model calls two operators,
//
//   torch.ops.minivllm.int4_linear(x, packed, scale, minimum)   x @ w.T for an int4 weight
//   torch.ops.minivllm.int8_linear(x, q, scale)                 the same for an int8 one
//
// which choose by the row count: a few rows (a decode step) the register-blocked products,
// more the tiled one. Each product is an operator of its own too (torch.ops.minivllm_cpu.*):
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
        for_column_tiles<decltype(rows_)::value>(weight, begin, end, [&](auto cols_, int64_t col) {
          gemv_tile<decltype(rows_)::value, decltype(cols_)::value>(weight, values.data_ptr<float>(), dst, n,
                                                                    col);
        });
      });
    });
  });
}

#if defined(MINIVLLM_AVX512_BF16)
// bfloat16 activations times int4 weights, by AVX512-BF16's pair dot product: one instruction
// multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes. The weights' levels 0..15 are
// bfloat16 numbers exactly, so a block needs no float conversion: its 32 nibbles become 16-bit
// indices into a table of the 16 levels as bfloat16 (one permute), and the group's
// sum(q * x) is then scaled once, w * x summed as scale * sum(q * x) + minimum * sum(x). Each
// product q * x is exact in float32 and the sums are float32's, as in the float product above;
// sum(x) per group is made once per call. (Without the table, the usual trick reads the bits
// 0x4300 | q as the bfloat16 128 + q; subtracting 128 * sum(x) afterwards cancels most of the
// sum's bits, and a group whose levels are all 0 came out wrong by 1e-7 of sum(|x|).)
inline __m512i int4_block_levels_bf16(const uint8_t* bytes) {
  // bfloat16 of 0..15 (a float's upper 16 bits), in the first 16 of 32 words
  const __m512i levels = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160,
                                          0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0,
                                          0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  // words 0-15 and 16-31 both hold bytes 0-15; the first 16 keep the low nibbles (weights
  // 0-15), the last 16 shift the high ones down (weights 16-31)
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                          0x0004000400040004, 0, 0, 0, 0);
  const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi16(words, shifts), _mm512_set1_epi16(15));
  return _mm512_permutexvar_epi16(nibbles, levels);
}

// Up to 16 floats from p on (count of them; the other lanes 0), from float32 or float16.
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? 0xFFFF : (1u << count) - 1; }
inline __m512 load_floats(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first_lanes(count), p); }
inline __m512 load_floats(const c10::Half* p, int64_t count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), p));
}

template <int64_t Rows, int64_t Cols, typename Scale>
void bf16_gemv_tile(const Int4Weight<Scale> weight, const at::BFloat16* x, const float* x_sums,
                    at::BFloat16* out, int64_t n, int64_t col) {
  const int64_t k = weight.k, groups = weight.groups;
  __m512 acc[Rows][Cols];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  // scale * sum(q * x), group by group
  for (int64_t g = 0, b = 0; g < groups; ++g) {
    __m512 group_acc[Rows][Cols];
    for (int64_t r = 0; r < Rows; ++r)
      for (int64_t c = 0; c < Cols; ++c) group_acc[r][c] = _mm512_setzero_ps();
    for (const int64_t group_end = b + weight.blocks_per_group; b < group_end; ++b) {
      __m512i w[Cols];
      for (int64_t c = 0; c < Cols; ++c) w[c] = int4_block_levels_bf16(weight.block(col + c, b));
      for (int64_t r = 0; r < Rows; ++r) {
        const __m512i xv = _mm512_loadu_si512(x + r * k + b * kBlock);
        for (int64_t c = 0; c < Cols; ++c)
          group_acc[r][c] = _mm512_dpbf16_ps(group_acc[r][c], (__m512bh)w[c], (__m512bh)xv);
      }
    }
    for (int64_t c = 0; c < Cols; ++c) {
      const __m512 scale = _mm512_set1_ps(weight.scale(col + c, g));
      for (int64_t r = 0; r < Rows; ++r) acc[r][c] = _mm512_fmadd_ps(group_acc[r][c], scale, acc[r][c]);
    }
  }
  // + minimum * sum(x) of every group, 16 groups a vector (kept out of the loop above: a scalar
  // sum carried from group to group waited on itself there)
  for (int64_t g = 0; g < groups; g += 16) {
    const int64_t count = std::min<int64_t>(16, groups - g);
    for (int64_t c = 0; c < Cols; ++c) {
      const __m512 minimums = load_floats(weight.minimums + (col + c) * groups + g, count);
      for (int64_t r = 0; r < Rows; ++r)
        acc[r][c] = _mm512_fmadd_ps(minimums, load_floats(x_sums + r * groups + g, count), acc[r][c]);
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) out[r * n + col + c] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[r][c]));
}

template <typename Scale>
void bf16_gemv(at::Tensor& out, const at::Tensor& x, const Int4Weight<Scale>& weight, int64_t n) {
  const at::Tensor values = x.contiguous();
  const auto* rows = values.data_ptr<at::BFloat16>();
  // sum(x) of each row's groups, in float32 (a plain loop: ATen's ops cost microseconds a call)
  const int64_t group_size = weight.k / weight.groups;
  std::vector<float> x_sums(x.size(0) * weight.groups, 0.0f);
  for (int64_t i = 0; i < x.numel(); ++i) x_sums[i / group_size] += static_cast<float>(rows[i]);
  auto* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    with_row_count(x.size(0), [&](auto rows_) {
      for_column_tiles<decltype(rows_)::value>(weight, begin, end, [&](auto cols_, int64_t col) {
        bf16_gemv_tile<decltype(rows_)::value, decltype(cols_)::value>(weight, rows, x_sums.data(),
                                                                       dst, n, col);
      });
    });
  });
}

// More rows than the register-blocked product takes (a batch of decodes): a step is then
// bound by arithmetic, not bytes. Four columns of the weight at a time are dequantized once into
// a buffer that stays in L1, rounded to bfloat16 (w = level * scale + minimum, or q * scale for
// int8, as the tiled product's float tiles are), and multiplied with every row, six rows at a
// time, by the pair dot product: no per-group work in the inner loop, and the integers are read
// from memory once. (A 6 x 4 tile: 10 loads for 24 dot products; 8 x 2 needed 10 for 16.)
constexpr int64_t kTileColumns = 4, kTileRows = 6;  // 24 accumulators of 32 registers

template <int64_t Rows, int64_t Cols>
void bf16_rows_tile(const at::BFloat16* w, const at::BFloat16* x, int64_t k, at::BFloat16* out, int64_t n,
                    int64_t col) {
  __m512 acc[Rows][Cols];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += kBlock) {
    __m512i wv[Cols];
    for (int64_t c = 0; c < Cols; ++c) wv[c] = _mm512_loadu_si512(w + c * k + j);
    for (int64_t r = 0; r < Rows; ++r) {
      const __m512i xv = _mm512_loadu_si512(x + r * k + j);
      for (int64_t c = 0; c < Cols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[c], (__m512bh)xv);
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < Cols; ++c) out[r * n + col + c] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[r][c]));
}

template <typename Weight>
void dequantize_columns_bf16(const Weight& weight, int64_t col, int64_t cols, at::BFloat16* w) {
  for (int64_t c = 0; c < cols; ++c) {
    const Vec column_scale(weight.output_scale(col + c));  // an int8 row's scale; 1 for int4
    for (int64_t b = 0; b < weight.k / kBlock; ++b) {
      Vec values[kBlockVecs];
      weight.dequantize(col + c, b, weight.group(col + c, b / weight.blocks_per_group), values);
      _mm512_storeu_si512(w + c * weight.k + b * kBlock,
                          (__m512i)_mm512_cvtne2ps_pbh(values[1] * column_scale, values[0] * column_scale));
    }
  }
}

template <typename Weight>
void bf16_rows(at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t n) {
  const at::Tensor values = x.contiguous();
  const auto* rows = values.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  const int64_t m = x.size(0), k = weight.k, ahead = prefetch_distance(weight);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> columns(kTileColumns * k);
    for (int64_t col = begin; col < end; col += kTileColumns) {
      const int64_t cols = std::min(kTileColumns, end - col);
      weight.prefetch_columns(std::min(col + ahead, end), std::min(col + ahead + cols, end));
      dequantize_columns_bf16(weight, col, cols, columns.data());
      for (int64_t row = 0; row < m; row += kTileRows) {
        with_row_count<kTileRows>(std::min(kTileRows, m - row), [&](auto rows_) {
          constexpr int64_t Rows = decltype(rows_)::value;
          const at::BFloat16* x_rows = rows + row * k;
          if (cols == kTileColumns) {
            bf16_rows_tile<Rows, kTileColumns>(columns.data(), x_rows, k, dst + row * n, n, col);
          } else {  // the last columns of a thread's run, one at a time
            for (int64_t c = 0; c < cols; ++c)
              bf16_rows_tile<Rows, 1>(columns.data() + c * k, x_rows, k, dst + row * n, n, col + c);
          }
        });
      }
    }
  });
}
#endif

void int4_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum) {
  with_int4_weight(out, x, packed, scale, minimum, [&](const auto& weight) {
#if defined(MINIVLLM_AVX512_BF16)
    if (x.scalar_type() == at::kBFloat16) return bf16_gemv(out, x, weight, packed.size(0));
#endif
    gemv(out, x, weight, packed.size(0));
  });
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

// x @ w.T for many rows: w made `tile_rows` rows at a time by `dequantize_tile(tile, first_row)`
// into one reused buffer, and a float matrix product (ATen's, oneDNN on a CPU) of x with each
// tile, written into its columns of the output. No float copy of the whole weight is made.
template <typename DequantizeTile>
at::Tensor tiled_linear(const at::Tensor& x, int64_t n, int64_t tile_rows, DequantizeTile&& dequantize_tile) {
  TORCH_CHECK(tile_rows > 0, "tile_rows must be positive, got ", tile_rows);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  at::Tensor buffer = at::empty({std::min(n, tile_rows), x.size(1)}, x.options());
  for (int64_t begin = 0; begin < n; begin += tile_rows) {
    at::Tensor tile = buffer.narrow(0, 0, std::min(n - begin, tile_rows));
    dequantize_tile(tile, begin);
    out.narrow(1, begin, tile.size(0)).copy_(at::linear(x, tile));
  }
  return out;
}

// The operators the model calls (torch.ops.minivllm.int4_linear / int8_linear): x [M, K] @ w.T,
// [M, N] in x's dtype. Up to kMaxGemvRows rows the register-blocked product (with
// `int8_activations`, the one that quantizes the rows to int8 blocks first: W4A8, W8A8), more
// rows the tiled one. Chosen here, when the call runs, so a compiled graph holds one opaque call
// and is guarded on nothing; written in C++ because a Python operator's own cost (~5 us a call,
// 120 calls a step) was a tenth of a batch-1 step.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& minimum, bool int8_activations, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * 2, "x must be [rows, ", packed.size(1) * 2,
              "], got ", x.sizes());
  if (x.size(0) <= kMaxGemvRows) {
    at::Tensor out = at::empty({x.size(0), packed.size(0)}, x.options());
    (int8_activations ? w4a8_gemv : int4_gemv)(out, x, packed, scale, minimum);
    return out;
  }
#if defined(MINIVLLM_AVX512_BF16)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) <= kMaxBf16Rows) {
    at::Tensor out = at::empty({x.size(0), packed.size(0)}, x.options());
    DISPATCH_SCALE_TYPES(scale.scalar_type(), "int4 rows", [&] {
      bf16_rows(out, x, int4_weight<scalar_t>(packed, scale, minimum), packed.size(0));
    });
    return out;
  }
#endif
  return tiled_linear(x, packed.size(0), tile_rows,
                      [&](at::Tensor& tile, int64_t begin) { int4_dequantize(tile, packed, scale, minimum, begin); });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, bool int8_activations,
                       int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1), "x must be [rows, ", q.size(1), "], got ", x.sizes());
  if (x.size(0) <= kMaxGemvRows) {
    at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
    (int8_activations ? w8a8_gemv : int8_gemv)(out, x, q, scale);
    return out;
  }
#if defined(MINIVLLM_AVX512_BF16)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) <= kMaxBf16Rows) {
    at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
    bf16_rows(out, x, int8_weight(q, scale), q.size(0));
    return out;
  }
#endif
  return tiled_linear(x, q.size(0), tile_rows,
                      [&](at::Tensor& tile, int64_t begin) { int8_dequantize(tile, q, scale, begin); });
}

// For the compiler (chapter 11): the result's shape and dtype, without running anything. The
// sizes are symbolic there (sym_size), so the row count stays a variable of the graph.
at::Tensor int4_linear_shape(const at::Tensor& x, const at::Tensor& packed, const at::Tensor&, const at::Tensor&,
                             bool, int64_t) {
  return at::empty_symint({x.sym_size(0), packed.sym_size(0)}, x.options());
}

at::Tensor int8_linear_shape(const at::Tensor& x, const at::Tensor& q, const at::Tensor&, bool, int64_t) {
  return at::empty_symint({x.sym_size(0), q.sym_size(0)}, x.options());
}

}  // namespace

// Rows of a weight dequantized at a time by the tiled product: 4.5 MiB of bfloat16 for K = 576.
#define MINIVLLM_TILE_ROWS "4096"

TORCH_LIBRARY_FRAGMENT(minivllm, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor minimum, bool int8_activations=False,"
        " int tile_rows=" MINIVLLM_TILE_ROWS ") -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, bool int8_activations=False, int tile_rows=" MINIVLLM_TILE_ROWS
        ") -> Tensor");
}

TORCH_LIBRARY_IMPL(minivllm, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_IMPL(minivllm, Meta, m) {
  m.impl("int4_linear", &int4_linear_shape);
  m.impl("int8_linear", &int8_linear_shape);
}

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
