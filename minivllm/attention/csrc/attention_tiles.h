// Chapter 06, "The same kernel on a CPU": the vector arithmetic of one chunk of keys, the inner
// loops of `paged_attention.cpp`. A chunk is at most kChunkKeys keys of one block; every query row
// of a work item folds it into its running softmax: scores (dot products for a decode's few rows,
// a small matrix product for a prefill tile's many), their exponentials, and the weighted values.
// Vectors are ATen's at::vec::Vectorized<float>, 16 floats with AVX512, 8 with AVX2.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace minivllm_cpu {

using Vec = at::vec::Vectorized<float>;
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

}  // namespace minivllm_cpu
