// Chapter 06, "The same kernel on a CPU": paged attention over the whole flat batch in one call,
// reading K/V where they lie in the pool. Built at first use by `attention/cpu_paged.py`.
//
// Two operators, registered as torch.ops.minivllm_cpu.*:
//   store_kv(kv, k, v, slot_mapping)        the new tokens' K/V into their pool slots
//   paged_attention(out, q, kv, block_tables, work, merges, scale, max_splits)
//
// The step's work is planned once in Python (`plan_work`) and reused by every layer. A work item
// is one sequence's slice of query rows, for one K/V head, over one range of its keys:
//   work[i] = [seq, kv_head, row_begin, row_end, first_position, key_begin, key_end, split]
// The thread that takes an item attends every query head of the K/V head's group (GQA), so each
// K/V block is read once per item, not once per query head. An item whose keys are the whole
// visible context (split = -1) writes its rows of `out`; a long decode is cut into splits along
// its keys, each writes a partial result and its log-sum-exp, and `merges` lists the rows whose
// splits are then merged: the algorithm of chapter 06's Triton decode kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kWorkFields = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scores of one query against `count` keys, `stride` floats apart. Four keys at a time: four
// independent chains of multiply-adds keep the vector units busy, where one dot product after
// another would wait on each add. The last dimensions (dim not a multiple of the vector width)
// and the last keys go one at a time.
inline void dot_keys(const float* q, const float* keys, int64_t stride, int64_t count,
                     int64_t dim, float* scores) {
  const int64_t vector_dims = dim - dim % Vec::size();
  auto tail = [&](const float* k, float total) {
    for (int64_t d = vector_dims; d < dim; ++d) total += q[d] * k[d];
    return total;
  };
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float *k0 = keys + j * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    Vec s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);
    for (int64_t d = 0; d < vector_dims; d += Vec::size()) {
      const Vec query = Vec::loadu(q + d);
      s0 = at::vec::fmadd(query, Vec::loadu(k0 + d), s0);
      s1 = at::vec::fmadd(query, Vec::loadu(k1 + d), s1);
      s2 = at::vec::fmadd(query, Vec::loadu(k2 + d), s2);
      s3 = at::vec::fmadd(query, Vec::loadu(k3 + d), s3);
    }
    scores[j] = tail(k0, at::vec::vec_reduce_all<float>(std::plus<Vec>(), s0));
    scores[j + 1] = tail(k1, at::vec::vec_reduce_all<float>(std::plus<Vec>(), s1));
    scores[j + 2] = tail(k2, at::vec::vec_reduce_all<float>(std::plus<Vec>(), s2));
    scores[j + 3] = tail(k3, at::vec::vec_reduce_all<float>(std::plus<Vec>(), s3));
  }
  for (; j < count; ++j) {
    const float* k = keys + j * stride;
    Vec sum(0.0f);
    for (int64_t d = 0; d < vector_dims; d += Vec::size())
      sum = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), sum);
    scores[j] = tail(k, at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum));
  }
}

// acc = acc * rescale + sum_j p[j] * v_j over `count` value rows. Four vectors of acc at a time
// are held in registers across all the rows, twice over: even rows add into one set, odd rows
// into the other, so eight independent chains of multiply-adds keep both vector units busy. The
// last vectors and dimensions go one at a time. (Named variables, not an array: the compiler
// keeps an array of vectors in memory, since any float pointer may alias it.)
inline void add_weighted_values(float* acc, float rescale, const float* p, const float* values,
                                int64_t stride, int64_t count, int64_t dim) {
  constexpr int64_t V = Vec::size();
  const int64_t vector_dims = dim - dim % V;
  int64_t d = 0;
  for (; d + 4 * V <= vector_dims; d += 4 * V) {
    Vec e0 = Vec::loadu(acc + d) * Vec(rescale), e1 = Vec::loadu(acc + d + V) * Vec(rescale);
    Vec e2 = Vec::loadu(acc + d + 2 * V) * Vec(rescale), e3 = Vec::loadu(acc + d + 3 * V) * Vec(rescale);
    Vec o0(0.0f), o1(0.0f), o2(0.0f), o3(0.0f);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
      const float *v = values + j * stride + d, *w = v + stride;
      const Vec pv(p[j]), pw(p[j + 1]);
      e0 = at::vec::fmadd(pv, Vec::loadu(v), e0);
      e1 = at::vec::fmadd(pv, Vec::loadu(v + V), e1);
      e2 = at::vec::fmadd(pv, Vec::loadu(v + 2 * V), e2);
      e3 = at::vec::fmadd(pv, Vec::loadu(v + 3 * V), e3);
      o0 = at::vec::fmadd(pw, Vec::loadu(w), o0);
      o1 = at::vec::fmadd(pw, Vec::loadu(w + V), o1);
      o2 = at::vec::fmadd(pw, Vec::loadu(w + 2 * V), o2);
      o3 = at::vec::fmadd(pw, Vec::loadu(w + 3 * V), o3);
    }
    if (j < count) {
      const float* v = values + j * stride + d;
      const Vec pv(p[j]);
      e0 = at::vec::fmadd(pv, Vec::loadu(v), e0);
      e1 = at::vec::fmadd(pv, Vec::loadu(v + V), e1);
      e2 = at::vec::fmadd(pv, Vec::loadu(v + 2 * V), e2);
      e3 = at::vec::fmadd(pv, Vec::loadu(v + 3 * V), e3);
    }
    (e0 + o0).store(acc + d);
    (e1 + o1).store(acc + d + V);
    (e2 + o2).store(acc + d + 2 * V);
    (e3 + o3).store(acc + d + 3 * V);
  }
  for (; d < vector_dims; d += Vec::size()) {
    Vec a = Vec::loadu(acc + d) * Vec(rescale);
    for (int64_t j = 0; j < count; ++j)
      a = at::vec::fmadd(Vec(p[j]), Vec::loadu(values + j * stride + d), a);
    a.store(acc + d);
  }
  for (; d < dim; ++d) {
    float a = acc[d] * rescale;
    for (int64_t j = 0; j < count; ++j) a += p[j] * values[j * stride + d];
    acc[d] = a;
  }
}

// The pool's dtypes: float32, and the 16-bit ones, which are widened to float32 to compute.
#define AT_DISPATCH_CASE_FLOATING_AND_REDUCED(...)    \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)           \
  AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)        \
  AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)

// Rows of K or V as float32, `stride` floats apart: a float32 pool is read in place; bfloat16 rows
// are widened once into `scratch`, then serve every query head of the group.
struct FloatRows {
  const float* data;
  int64_t stride;
};

template <typename T>
inline FloatRows as_float(const T* rows, int64_t count, int64_t stride, int64_t dim,
                          float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return {rows, stride};
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const T* src = rows + j * stride;
      float* dst = scratch + j * dim;
      int64_t d = 0;
      for (; d + Vec::size() <= dim; d += Vec::size()) {
        Vec widened;
        at::vec::load_to_float(src + d, widened);
        widened.store(dst + d);
      }
      for (; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
    }
    return {scratch, dim};
  }
}

// The running softmax of one query row: its largest score so far and the sum of exp(score - max)
// (kept lane by lane in a vector, plus a scalar for the keys past the last whole vector, and added
// up once at the end); the weighted sum of values (`acc`, head_dim floats) is kept apart.
struct RunningSoftmax {
  float max_score = kNegInf;
  Vec lanes = Vec(0.0f);
  float rest = 0.0f;
  float sum() const { return at::vec::vec_reduce_all<float>(std::plus<Vec>(), lanes) + rest; }
};

// Fold one row's scores over a chunk of `count` keys into its running softmax: exponentials in
// place of the scores (vectorized), the old sum rescaled once, then the weighted values into acc.
inline void update_row(float* scores, int64_t count, const FloatRows& values, int64_t dim,
                       RunningSoftmax& state, float* acc) {
  Vec maxima(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= count; j += Vec::size()) maxima = at::vec::maximum(maxima, Vec::loadu(scores + j));
  float chunk_max = at::vec::vec_reduce_all<float>(
      [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, maxima);
  for (; j < count; ++j) chunk_max = std::max(chunk_max, scores[j]);
  // A new maximum rescales what was summed so far; exp never sees a positive argument.
  const float new_max = std::max(state.max_score, chunk_max);
  // (0 for the row's first chunk; 1, without calling exp, when the maximum did not move.)
  const float rescale = new_max == state.max_score ? 1.0f : std::exp(state.max_score - new_max);
  Vec sums(0.0f);
  for (j = 0; j + Vec::size() <= count; j += Vec::size()) {
    const Vec p = (Vec::loadu(scores + j) - Vec(new_max)).exp_u20();
    p.store(scores + j);
    sums = sums + p;
  }
  float rest = 0.0f;
  for (; j < count; ++j) rest += scores[j] = std::exp(scores[j] - new_max);
  state.lanes = at::vec::fmadd(state.lanes, Vec(rescale), sums);
  state.rest = state.rest * rescale + rest;
  state.max_score = new_max;
  add_weighted_values(acc, rescale, scores, values.data, values.stride, count, dim);
}

// Many rows against one chunk (a prefill tile): a matrix product. The chunk's keys are transposed
// once into `kt` ([dim][kChunkKeys], zero-padded), so that a row's scores over the whole chunk are
// one or two vectors: sum over d of q[d] * kt[d]. Rows go kRowBlock at a time, each row's
// vectors an independent chain of multiply-adds, and no sum across a vector's lanes is needed.
constexpr int64_t kChunkKeys = 16;
constexpr int64_t kScoreVecs = kChunkKeys / Vec::size();  // 1 with AVX512, 2 with AVX2
constexpr int64_t kRowBlock = 8 / kScoreVecs;

inline void transpose_keys(const FloatRows& keys, int64_t count, int64_t dim, float* kt) {
  for (int64_t j = 0; j < kChunkKeys; ++j)
    for (int64_t d = 0; d < dim; ++d)
      kt[d * kChunkKeys + j] = j < count ? keys.data[j * keys.stride + d] : 0.0f;
}

// Eight accumulators, named (see add_weighted_values): accumulator i holds row i / kScoreVecs's
// scores for keys (i % kScoreVecs) * Vec::size() onwards.
inline void scores_of_row_block(const float* queries, int64_t dim, const float* kt, float* scores) {
  static_assert(kRowBlock * kScoreVecs == 8, "eight accumulators");
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f), a4(0.0f), a5(0.0f), a6(0.0f), a7(0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    const Vec k0 = Vec::loadu(kt + d * kChunkKeys);
    const Vec k1 = kScoreVecs > 1 ? Vec::loadu(kt + d * kChunkKeys + Vec::size()) : k0;
    auto add = [&](Vec& acc, int64_t i) {
      acc = at::vec::fmadd(Vec(queries[(i / kScoreVecs) * dim + d]), i % kScoreVecs ? k1 : k0, acc);
    };
    add(a0, 0), add(a1, 1), add(a2, 2), add(a3, 3), add(a4, 4), add(a5, 5), add(a6, 6), add(a7, 7);
  }
  auto store = [&](const Vec& acc, int64_t i) {
    acc.store(scores + (i / kScoreVecs) * kChunkKeys + (i % kScoreVecs) * Vec::size());
  };
  store(a0, 0), store(a1, 1), store(a2, 2), store(a3, 3), store(a4, 4), store(a5, 5), store(a6, 6),
      store(a7, 7);
}

// One row's scores against the transposed chunk, for the rows left over after the blocks.
inline void scores_of_row(const float* query, int64_t dim, const float* kt, float* scores) {
  for (int64_t v = 0; v < kScoreVecs; ++v) {
    Vec acc(0.0f);
    for (int64_t d = 0; d < dim; ++d)
      acc = at::vec::fmadd(Vec(query[d]), Vec::loadu(kt + d * kChunkKeys + v * Vec::size()), acc);
    acc.store(scores + v * Vec::size());
  }
}

struct Pool {  // where K/V of (block, offset, head) lie: [2, blocks, block_size, kv_heads, dim]
  int64_t num_blocks, block_size, num_kv_heads, dim;
  int64_t token_stride() const { return num_kv_heads * dim; }
  int64_t half_stride() const { return num_blocks * block_size * token_stride(); }
};

// Attend one work item. Rows are (query token, query head of the group); query row r of the slice
// sits at position first_position + r and sees keys up to there (the causal mask shifted by the
// sequence's cached tokens), clipped to the item's key range [key_begin, key_end).
template <typename T>
void attend_item(const int32_t* item, const T* q, int64_t q_token_stride, const T* kv,
                 const int32_t* block_table, const Pool& pool, int64_t num_heads, float scale,
                 T* out, float* partial_out, float* partial_lse, int64_t max_splits) {
  const int64_t kv_head = item[1], row_begin = item[2], row_end = item[3];
  const int64_t first_position = item[4], key_begin = item[5], key_end = item[6];
  const int64_t split = item[7];
  const int64_t dim = pool.dim, group = num_heads / pool.num_kv_heads;
  const int64_t num_rows = (row_end - row_begin) * group;

  // This item's queries as float32, pre-multiplied by the softmax scale, and their accumulators.
  std::vector<float> queries(num_rows * dim), acc(num_rows * dim, 0.0f);
  std::vector<RunningSoftmax> state(num_rows);
  for (int64_t t = 0; t < row_end - row_begin; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + (row_begin + t) * q_token_stride + (kv_head * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d)
        queries[(t * group + g) * dim + d] = static_cast<float>(src[d]) * scale;
    }

  // Keys are taken kChunkKeys at a time within a block: one lookup in the block table, one
  // rescale of each row's sum per chunk. The last row sees the most keys; none past it is read.
  // With few rows (a decode's group of query heads), each row's scores are dot products; with
  // many (a prefill tile), the matrix product of `scores_of_row_block`.
  const bool many_rows = num_rows >= kRowBlock;
  std::vector<float> k_scratch(kChunkKeys * dim), v_scratch(kChunkKeys * dim), kt(kChunkKeys * dim);
  std::vector<float> scores(num_rows * kChunkKeys);
  const int64_t last_key = std::min(key_end, first_position + (row_end - row_begin));
  for (int64_t chunk_begin = key_begin, chunk_end; chunk_begin < last_key; chunk_begin = chunk_end) {
    chunk_end = std::min({last_key, chunk_begin + kChunkKeys,
                          (chunk_begin / pool.block_size + 1) * pool.block_size});
    const int64_t block = block_table[chunk_begin / pool.block_size];
    const int64_t first_slot = block * pool.block_size + chunk_begin % pool.block_size;
    const T* k_rows = kv + first_slot * pool.token_stride() + kv_head * dim;
    const int64_t count = chunk_end - chunk_begin, stride = pool.token_stride();
    const FloatRows keys = as_float(k_rows, count, stride, dim, k_scratch.data());
    const FloatRows values = as_float(k_rows + pool.half_stride(), count, stride, dim, v_scratch.data());
    // Row r sees keys up to position first_position + r / group: later ones are its future.
    auto visible = [&](int64_t row) {
      return std::min(count, first_position + row / group - chunk_begin + 1);
    };
    int64_t row = 0;
    if (many_rows) {
      transpose_keys(keys, count, dim, kt.data());
      for (; row + kRowBlock <= num_rows; row += kRowBlock)
        scores_of_row_block(queries.data() + row * dim, dim, kt.data(),
                            scores.data() + row * kChunkKeys);
      for (; row < num_rows; ++row)
        scores_of_row(queries.data() + row * dim, dim, kt.data(), scores.data() + row * kChunkKeys);
    } else {
      for (; row < num_rows; ++row)
        if (visible(row) > 0)
          dot_keys(queries.data() + row * dim, keys.data, keys.stride, visible(row), dim,
                   scores.data() + row * kChunkKeys);
    }
    for (row = 0; row < num_rows; ++row)
      if (visible(row) > 0)
        update_row(scores.data() + row * kChunkKeys, visible(row), values, dim, state[row],
                   acc.data() + row * dim);
  }

  for (int64_t t = 0; t < row_end - row_begin; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = t * group + g, head = kv_head * group + g, token = row_begin + t;
      const float max_score = state[row].max_score, sum = state[row].sum();
      const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;  // an empty split has sum 0
      if (split < 0) {
        T* dst = out + (token * num_heads + head) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[row * dim + d] * inv_sum);
      } else {
        const int64_t at = (token * num_heads + head) * max_splits + split;
        for (int64_t d = 0; d < dim; ++d) partial_out[at * dim + d] = acc[row * dim + d] * inv_sum;
        partial_lse[at] = sum > 0.0f ? max_score + std::log(sum) : kNegInf;
      }
    }
}

// Merge a row's splits: each partial result is weighted by exp(its log-sum-exp - the largest).
template <typename T>
void merge_row(int64_t token, int64_t num_splits, int64_t num_heads, int64_t dim,
               int64_t max_splits, const float* partial_out, const float* partial_lse, T* out) {
  for (int64_t head = 0; head < num_heads; ++head) {
    const int64_t at = (token * num_heads + head) * max_splits;
    float largest = kNegInf;
    for (int64_t s = 0; s < num_splits; ++s) largest = std::max(largest, partial_lse[at + s]);
    std::vector<float> merged(dim, 0.0f);
    float total = 0.0f;
    for (int64_t s = 0; s < num_splits; ++s) {
      const float w = std::exp(partial_lse[at + s] - largest);
      total += w;
      for (int64_t d = 0; d < dim; ++d) merged[d] += w * partial_out[(at + s) * dim + d];
    }
    T* dst = out + (token * num_heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(merged[d] / total);
  }
}

// A token's [heads, dim] lie dense, tokens any distance apart: the model's q, k and v are column
// slices of one fused projection, read where they are instead of copied.
bool rows_are_dense(const at::Tensor& t) {
  return t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)) &&
         (t.size(0) == 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// Every item is checked before any thread starts: a bad plan or block table is an error, never a
// read outside the pool.
void check_work(const at::Tensor& work, const at::Tensor& block_tables, const Pool& pool,
                int64_t num_tokens, int64_t max_splits) {
  const int32_t* w = work.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t i = 0; i < work.size(0); ++i) {
    const int32_t* item = w + i * kWorkFields;
    TORCH_CHECK(item[0] >= 0 && item[0] < block_tables.size(0), "work item ", i,
                ": sequence ", item[0], " has no block table");
    TORCH_CHECK(item[1] >= 0 && item[1] < pool.num_kv_heads, "work item ", i, ": K/V head ",
                item[1], " out of range");
    TORCH_CHECK(0 <= item[2] && item[2] < item[3] && item[3] <= num_tokens, "work item ", i,
                ": query rows [", item[2], ", ", item[3], ") not in the batch's ", num_tokens);
    TORCH_CHECK(0 <= item[5] && item[5] <= item[6] && item[6] <= width * pool.block_size,
                "work item ", i, ": keys [", item[5], ", ", item[6], ") beyond its block table");
    TORCH_CHECK(item[4] >= 0 && item[7] < max_splits, "work item ", i, ": bad position or split");
    const int64_t blocks_read = (std::min<int64_t>(item[6], item[4] + item[3] - item[2]) +
                                 pool.block_size - 1) / pool.block_size;
    for (int64_t b = item[5] / pool.block_size; b < blocks_read; ++b) {
      const int32_t block = tables[item[0] * width + b];
      TORCH_CHECK(block >= 0 && block < pool.num_blocks, "sequence ", item[0], " names block ",
                  block, ", the pool has ", pool.num_blocks);
    }
  }
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv,
                     const at::Tensor& block_tables, const at::Tensor& work,
                     const at::Tensor& merges, double scale, int64_t max_splits) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous(),
              "kv must be a contiguous pool [2, blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kv.size(4) && rows_are_dense(q),
              "q must be [tokens, heads, dim] with the pool's head size, each token's heads dense");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be shaped like q");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv and out must share one dtype");
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "the cpu backend runs on the CPU");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(), "block_tables must be contiguous int32 [seqs, width]");
  TORCH_CHECK(work.scalar_type() == at::kInt && work.dim() == 2 && work.size(1) == kWorkFields &&
                  work.is_contiguous(), "work must be contiguous int32 [items, 8]");
  TORCH_CHECK(merges.scalar_type() == at::kInt && merges.dim() == 2 && merges.size(1) == 2 &&
                  merges.is_contiguous(), "merges must be contiguous int32 [rows, 2]");
  TORCH_CHECK(max_splits >= 1, "max_splits must be at least 1");
  const Pool pool{kv.size(1), kv.size(2), kv.size(3), kv.size(4)};
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), dim = pool.dim;
  check_work(work, block_tables, pool, num_tokens, max_splits);
  for (int64_t i = 0; i < merges.size(0); ++i) {
    const int32_t* m = merges.data_ptr<int32_t>() + 2 * i;
    TORCH_CHECK(0 <= m[0] && m[0] < num_tokens && 1 <= m[1] && m[1] <= max_splits,
                "merge ", i, " names row ", m[0], " with ", m[1], " splits");
  }

  // Partial results exist only for split rows; an unsplit step allocates almost nothing.
  const int64_t partial_rows = merges.size(0) > 0 ? num_tokens : 0;
  at::Tensor partial_out = at::empty({partial_rows, num_heads, max_splits, dim}, q.options().dtype(at::kFloat));
  at::Tensor partial_lse = at::empty({partial_rows, num_heads, max_splits}, q.options().dtype(at::kFloat));

  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention", AT_DISPATCH_CASE_FLOATING_AND_REDUCED([&] {
    const int32_t* items = work.data_ptr<int32_t>();
    const int64_t num_items = work.size(0), width = block_tables.size(1);
    // Items differ in cost (a prefill chunk against a decode), so threads do not get fixed
    // shares: each takes the next untaken item until none is left.
    std::atomic<int64_t> next_item{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i = next_item++; i < num_items; i = next_item++) {
        const int32_t* item = items + i * kWorkFields;
        attend_item<scalar_t>(item, q.data_ptr<scalar_t>(), q.stride(0), kv.data_ptr<scalar_t>(),
                              block_tables.data_ptr<int32_t>() + item[0] * width, pool, num_heads,
                              static_cast<float>(scale), out.data_ptr<scalar_t>(),
                              partial_out.data_ptr<float>(), partial_lse.data_ptr<float>(),
                              max_splits);
      }
    });
    at::parallel_for(0, merges.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int32_t* m = merges.data_ptr<int32_t>() + 2 * i;
        merge_row<scalar_t>(m[0], m[1], num_heads, dim, max_splits, partial_out.data_ptr<float>(),
                            partial_lse.data_ptr<float>(), out.data_ptr<scalar_t>());
      }
    });
  }));
}

// K and V of the new tokens into their slots, one memcpy per token and half, tokens in parallel.
void store_kv(at::Tensor kv, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous(),
              "kv must be a contiguous pool [2, blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv.size(3) &&
                  k.size(2) == kv.size(4) && rows_are_dense(k) && rows_are_dense(v),
              "k and v must be [tokens, kv_heads, dim] matching the pool, each token's heads dense");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
              "k, v and the pool must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int32, one slot per new token");
  const int64_t num_slots = kv.size(1) * kv.size(2);
  const int32_t* slots = slot_mapping.data_ptr<int32_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "token ", t, " has slot ", slots[t],
                ", the pool has ", num_slots);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  char* keys = static_cast<char*>(kv.data_ptr());
  char* values = keys + num_slots * row_bytes;
  const char* k_src = static_cast<const char*>(k.data_ptr());
  const char* v_src = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(keys + slots[t] * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(values + slots[t] * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(minivllm_cpu, m) {
  m.def("store_kv(Tensor(a!) kv, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor kv, Tensor block_tables, Tensor work, "
      "Tensor merges, float scale, int max_splits) -> ()");
}

TORCH_LIBRARY_IMPL(minivllm_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("paged_attention", &paged_attention);
}
