// Chapter 12: what the int4/int8 products share, the blocks of 32 weights and how to read them.
// `quantized_linear.cpp` multiplies them with float activations (W4A16, W8A16), and
// `quantized_linear_int8_activations.cpp` with activations quantized to int8 (W4A8, W8A8).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace minivllm_quantized {


using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 32;                       // weights of one 16-byte int4 block
constexpr int64_t kBlockVecs = kBlock / Vec::size();  // 2 with AVX512, 4 with AVX2
constexpr int64_t kMaxGemvRows = 8;                  // rows whose accumulators fit in registers
constexpr int64_t kMaxBf16Rows = 64;  // bfloat16 rows up to which int4 is multiplied in bfloat16 pairs

// Ask for bytes [begin, end) into L2 ahead of their use (see `for_column_tiles`). Inlined by
// force: GCC judges a function whose only work is prefetching to have no effect and deletes its
// calls (chapter 06's attention kernel met this first).
[[gnu::always_inline]] inline void prefetch_bytes(const void* begin, const void* end) {
  constexpr int kCacheLine = 64, kRead = 0, kIntoL2 = 2;
  for (const char* p = static_cast<const char*>(begin); p < end; p += kCacheLine)
    __builtin_prefetch(p, kRead, kIntoL2);
}

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

// A group's 16 possible weights, level * scale + minimum for levels 0..15, as one float vector
// (AVX512: 16 lanes): a block of the group is then dequantized by looking its 4-bit levels up
// in it, one permute per 16 weights, with no integer-to-float conversion and no multiply.
#if defined(CPU_CAPABILITY_AVX512)
struct Int4Levels {
  Vec levels;
  Int4Levels() = default;
  Int4Levels(float scale, float minimum)
      : levels(at::vec::fmadd(Vec(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                              Vec(scale), Vec(minimum))) {}
};

inline void dequantize_int4_block(const uint8_t* bytes, const Int4Levels& group, Vec* w) {
  const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  w[0] = _mm512_permutexvar_ps(_mm512_and_si512(all, _mm512_set1_epi32(15)), group.levels);  // 0-15
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(all, 4), group.levels);                      // 16-31
}
#else  // narrower vectors hold fewer than 16 levels: widen the levels, then one multiply-add
struct Int4Levels {
  Vec scale, minimum;
  Int4Levels() = default;
  Int4Levels(float scale_, float minimum_) : scale(scale_), minimum(minimum_) {}
};

inline void dequantize_int4_block(const uint8_t* bytes, const Int4Levels& group, Vec* w) {
  widen_int4_block(bytes, w);
  for (int64_t v = 0; v < kBlockVecs; ++v) w[v] = at::vec::fmadd(w[v], group.scale, group.minimum);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// A block's 32 integers as bytes of one 256-bit register, in weight order, for the integer dot
// products of `quantized_linear_int8_activations.cpp`.
inline __m256i int4_block_bytes(const uint8_t* bytes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low = _mm_set1_epi8(15);
  const __m128i first = _mm_and_si128(packed, low);                      // weights 0-15
  const __m128i second = _mm_and_si128(_mm_srli_epi16(packed, 4), low);  // weights 16-31
  return _mm256_set_m128i(second, first);
}

inline __m256i int8_block_bytes(const int8_t* bytes) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
}
#define MINIVLLM_INTEGER_BLOCKS 1
#endif

// A float16 scale as a float by F16C's one instruction (c10::Half's own conversion goes through
// a whole vector register and made each group's scales cost as much as its products), where
// the build has it.
inline float as_float(float value) { return value; }
inline float as_float(c10::Half value) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return _cvtsh_ss(value.x);
#else
  return static_cast<float>(value);
#endif
}

// The two weight formats, seen by the products through the same few questions: a block's
// integers (as bytes, for the integer products) or its float weights, a group's scale and
// minimum. Products walk a row group by group, so that what a group needs is read (and
// widened from float16) once: `group(col, g)`, handed to `dequantize` for each of its blocks.
// An int8 row is one group whose scale multiplies the output (`output_scale`), not each weight.
template <typename Scale>
struct Int4Weight {
  const uint8_t* packed;  // [N, K / 2]
  const Scale *scales, *minimums;  // [N, groups]
  int64_t k, groups, blocks_per_group;
  const uint8_t* block(int64_t col, int64_t b) const { return packed + col * (k / 2) + b * (kBlock / 2); }
  Int4Levels group(int64_t col, int64_t g) const { return {scale(col, g), minimum(col, g)}; }
  void dequantize(int64_t col, int64_t b, const Int4Levels& group, Vec* w) const {
    dequantize_int4_block(block(col, b), group, w);
  }
  float output_scale(int64_t) const { return 1.0f; }
  [[gnu::always_inline]] void prefetch_columns(int64_t first, int64_t last) const {
    prefetch_bytes(block(first, 0), block(last, 0));
    prefetch_bytes(scales + first * groups, scales + last * groups);
    prefetch_bytes(minimums + first * groups, minimums + last * groups);
  }
  int64_t column_bytes() const { return k / 2 + 2 * groups * sizeof(Scale); }
#ifdef MINIVLLM_INTEGER_BLOCKS
  __m256i bytes(int64_t col, int64_t b) const { return int4_block_bytes(block(col, b)); }
#endif
  float scale(int64_t col, int64_t group) const { return as_float(scales[col * groups + group]); }
  float minimum(int64_t col, int64_t group) const { return as_float(minimums[col * groups + group]); }
};

struct Int8Weight {  // one group, the whole row
  const int8_t* q;  // [N, K]
  const float* scales;  // [N]
  int64_t k, groups, blocks_per_group;
  int group(int64_t, int64_t) const { return 0; }  // nothing per group: the scale is the row's
  void dequantize(int64_t col, int64_t b, int, Vec* w) const { widen_int8_block(q + col * k + b * kBlock, w); }
  float output_scale(int64_t col) const { return scales[col]; }
  [[gnu::always_inline]] void prefetch_columns(int64_t first, int64_t last) const {
    prefetch_bytes(q + first * k, q + last * k);
    prefetch_bytes(scales + first, scales + last);
  }
  int64_t column_bytes() const { return k + sizeof(float); }
#ifdef MINIVLLM_INTEGER_BLOCKS
  __m256i bytes(int64_t col, int64_t b) const { return int8_block_bytes(q + col * k + b * kBlock); }
#endif
  float scale(int64_t col, int64_t) const { return scales[col]; }
  float minimum(int64_t, int64_t) const { return 0.0f; }
};

inline void check_activations(const at::Tensor& out, const at::Tensor& x, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.size(0) <= kMaxGemvRows, "the gemv takes at most ", kMaxGemvRows, " rows, got ", x.size(0));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && out.is_contiguous(),
              "out must be contiguous [", x.size(0), ", ", n, "]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share one dtype");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.device().is_cpu(), "x must be floating point, on the CPU");
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of ", kBlock, ", got ", k);
}

template <typename Scale>
inline Int4Weight<Scale> int4_weight(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum) {
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

inline Int8Weight int8_weight(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == q.size(0) &&
                  scale.is_contiguous(), "scale must be contiguous float32 [N]");
  return {q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(1), 1, q.size(1) / kBlock};
}

#define DISPATCH_SCALE_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))


// An operator's checked weight and activations, handed to `product(weight)`: an int4 weight
// with its scales' dtype resolved, or an int8 weight.
template <typename Product>
inline void with_int4_weight(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& scale, const at::Tensor& minimum, Product&& product) {
  DISPATCH_SCALE_TYPES(scale.scalar_type(), "int4 product", [&] {
    const auto weight = int4_weight<scalar_t>(packed, scale, minimum);
    check_activations(out, x, packed.size(0), weight.k);
    product(weight);
  });
}

template <typename Product>
inline void with_int8_weight(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q,
                             const at::Tensor& scale, Product&& product) {
  const Int8Weight weight = int8_weight(q, scale);
  check_activations(out, x, q.size(0), q.size(1));
  product(weight);
}

// Call f with the row count as a compile-time constant (1..kMaxGemvRows), so that a product's
// per-row accumulators are an array the compiler can keep in registers.
template <int64_t Rows = kMaxGemvRows, typename F>
inline void with_row_count(int64_t rows, F&& f) {
  if constexpr (Rows > 1) {
    if (rows < Rows) return with_row_count<Rows - 1>(rows, f);
  }
  f(std::integral_constant<int64_t, Rows>{});
}

// Products take output columns several at a time when there are few rows: the columns' weight
// rows are read side by side (more loads in flight) and share each load of the activations.
// The columns left over go one at a time.
constexpr int64_t column_tile(int64_t rows) { return rows >= 4 ? 1 : 4 / rows; }

// How far ahead of the tile being multiplied its thread asks for weight bytes. A thread walks
// its output columns in order, so its weight is one contiguous run of rows; the hardware
// prefetcher, which follows streams inside one 4 KB page, fell behind there: one thread read the
// 28 MB int8 LM head at 6.7 GB/s, though it streams memory at 21 GB/s and multiplied the same
// columns from the cache at 25 G weights/s; asking 8 KB ahead, 20.5 GB/s (2 and 4 KB: 11 and
// 18.8; 16 KB: 20.1).
constexpr int64_t kPrefetchBytes = 8192;

// That distance in output columns of `weight`.
template <typename Weight>
inline int64_t prefetch_distance(const Weight& weight) {
  return std::max<int64_t>(1, kPrefetchBytes / weight.column_bytes());
}

template <int64_t Rows, typename Weight, typename F>
inline void for_column_tiles(const Weight& weight, int64_t begin, int64_t end, F&& tile) {
  constexpr int64_t Cols = column_tile(Rows);
  const int64_t ahead = prefetch_distance(weight);
  int64_t col = begin;
  for (; col + Cols <= end; col += Cols) {
    weight.prefetch_columns(std::min(col + ahead, end), std::min(col + ahead + Cols, end));
    tile(std::integral_constant<int64_t, Cols>{}, col);
  }
  if constexpr (Cols > 1) {
    for (; col < end; ++col) tile(std::integral_constant<int64_t, 1>{}, col);
  }
}

// The products with int8 activations (quantized_linear_int8_activations.cpp), for the operators
// of quantized_linear.cpp that choose a product by the row count.
void w4a8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               const at::Tensor& minimum);
void w8a8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);

}  // namespace minivllm_quantized
