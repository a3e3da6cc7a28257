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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 32;                       // weights of one 16-byte int4 block
constexpr int64_t kBlockVecs = kBlock / Vec::size();  // 2 with AVX512, 4 with AVX2
constexpr int64_t kMaxGemvRows = 8;                  // rows whose accumulators fit in registers

// A block's 32 integers as float vectors, in weight order. The vector instructions widen bytes
// to 32-bit lanes and convert them; without them, a loop the compiler vectorizes as it can.
inline void widen_int4_block(const uint8_t* bytes, Vec* q) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(all, _mm512_set1_epi32(15)));  // weights 0-15
  q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(all, 4));                      // weights 16-31
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i first = _mm256_cvtepu8_epi32(packed), second = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8));
  const __m256i low = _mm256_set1_epi32(15);
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, low));   // weights 0-7
  q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, low));  // 8-15
  q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));    // 16-23
  q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));   // 24-31
#else
  float values[kBlock];
  for (int64_t j = 0; j < kBlock / 2; ++j) values[j] = bytes[j] & 15, values[j + 16] = bytes[j] >> 4;
  for (int64_t v = 0; v < kBlockVecs; ++v) q[v] = Vec::loadu(values + v * Vec::size());
#endif
}

inline void widen_int8_block(const int8_t* bytes, Vec* q) {
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t v = 0; v < 2; ++v)
    q[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * v))));
#elif defined(CPU_CAPABILITY_AVX2)
  for (int64_t v = 0; v < 4; ++v)
    q[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * v))));
#else
  float values[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) values[j] = bytes[j];
  for (int64_t v = 0; v < kBlockVecs; ++v) q[v] = Vec::loadu(values + v * Vec::size());
#endif
}

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

// Output columns [begin, end) of `Rows` activation rows; the row count is a template argument so
// that the rows' accumulators are registers. Per block: the weights widened once, then for every
// row the block's dot product with its integers, scaled once by the group's scale (the sum of
// x * (q * scale + minimum) is scale * sum(x * q) + minimum * sum(x)).
template <int64_t Rows, typename Weight, typename Out>
void gemv_columns(const Weight& weight, const FloatRows& x, int64_t k, Out* out, int64_t n,
                  int64_t begin, int64_t end) {
  const float* values = x.values.data_ptr<float>();
  const int64_t blocks = k / kBlock;
  for (int64_t col = begin; col < end; ++col) {
    Vec acc[Rows];
    float minimum_terms[Rows] = {};
    for (int64_t r = 0; r < Rows; ++r) acc[r] = Vec(0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      Vec q[kBlockVecs];
      weight.widen(col, b, q);
      const float scale = weight.scale(col, b), minimum = weight.minimum(col, b);
      for (int64_t r = 0; r < Rows; ++r) {
        const float* xr = values + r * k + b * kBlock;
        Vec dot = q[0] * Vec::loadu(xr);
        for (int64_t v = 1; v < kBlockVecs; ++v) dot = at::vec::fmadd(q[v], Vec::loadu(xr + v * Vec::size()), dot);
        acc[r] = at::vec::fmadd(dot, Vec(scale), acc[r]);
        minimum_terms[r] += minimum * x.block_sums[r * blocks + b];
      }
    }
    for (int64_t r = 0; r < Rows; ++r)
      out[r * n + col] = static_cast<Out>(at::vec::vec_reduce_all<float>(std::plus<Vec>(), acc[r]) + minimum_terms[r]);
  }
}

template <typename Weight, typename Out, int64_t Rows = kMaxGemvRows>
void gemv_rows(int64_t rows, const Weight& weight, const FloatRows& x, int64_t k, Out* out, int64_t n,
               int64_t begin, int64_t end) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return gemv_rows<Weight, Out, Rows - 1>(rows, weight, x, k, out, n, begin, end);
  }
  gemv_columns<Rows>(weight, x, k, out, n, begin, end);
}

// The two weight formats, seen by the product through the same three questions.
template <typename Scale>
struct Int4Weight {
  const uint8_t* packed;  // [N, K / 2]
  const Scale *scales, *minimums;  // [N, groups]
  int64_t k, groups, blocks_per_group;
  void widen(int64_t col, int64_t block, Vec* q) const {
    widen_int4_block(packed + col * (k / 2) + block * (kBlock / 2), q);
  }
  float scale(int64_t col, int64_t block) const {
    return static_cast<float>(scales[col * groups + block / blocks_per_group]);
  }
  float minimum(int64_t col, int64_t block) const {
    return static_cast<float>(minimums[col * groups + block / blocks_per_group]);
  }
};

struct Int8Weight {
  const int8_t* q;  // [N, K]
  const float* scales;  // [N]
  int64_t k;
  void widen(int64_t col, int64_t block, Vec* out) const { widen_int8_block(q + col * k + block * kBlock, out); }
  float scale(int64_t col, int64_t) const { return scales[col]; }
  float minimum(int64_t, int64_t) const { return 0.0f; }
};

void check_activations(const at::Tensor& out, const at::Tensor& x, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.size(0) <= kMaxGemvRows, "the gemv takes at most ", kMaxGemvRows, " rows, got ", x.size(0));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && out.is_contiguous(),
              "out must be contiguous [", x.size(0), ", ", n, "]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share one dtype");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.device().is_cpu(), "x must be floating point, on the CPU");
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of ", kBlock, ", got ", k);
}

template <typename Scale>
Int4Weight<Scale> int4_weight(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.sizes() == minimum.sizes() &&
                  scale.is_contiguous() && minimum.is_contiguous() && scale.scalar_type() == minimum.scalar_type(),
              "scale and minimum must be contiguous [N, groups] of one dtype");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % kBlock == 0,
              "a group must be a whole number of ", kBlock, "-weight blocks: K ", k, ", groups ", groups);
  return {packed.data_ptr<uint8_t>(), scale.data_ptr<Scale>(), minimum.data_ptr<Scale>(), k, groups,
          k / groups / kBlock};
}

Int8Weight int8_weight(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == q.size(0) &&
                  scale.is_contiguous(), "scale must be contiguous float32 [N]");
  return {q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(1)};
}

// Threads take whole output columns; a grain of 16 columns keeps each thread on a long run of
// the weight, read once, front to back.
template <typename Weight>
void gemv(at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t n) {
  const FloatRows rows = as_float_rows(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "gemv", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      gemv_rows(x.size(0), weight, rows, weight.k, dst, n, begin, end);
    });
  });
}

#define DISPATCH_SCALE_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

void int4_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum) {
  DISPATCH_SCALE_TYPES(scale.scalar_type(), "int4_gemv", [&] {
    const auto weight = int4_weight<scalar_t>(packed, scale, minimum);
    check_activations(out, x, packed.size(0), weight.k);
    gemv(out, x, weight, packed.size(0));
  });
}

void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight weight = int8_weight(q, scale);
  check_activations(out, x, q.size(0), q.size(1));
  gemv(out, x, weight, q.size(0));
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
          const Vec scale(weight.scale(row_begin + row, b)), minimum(weight.minimum(row_begin + row, b));
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
