// Chapter 06, "The same kernel on a CPU": the vector arithmetic of one chunk of keys, the inner
// loops of `paged_attention.cpp`. Every query row of a work item folds each chunk into its running
// softmax: scores, their exponentials, and the weighted values. A decode's few rows take a chunk
// of at most kChunkKeys keys of one block, read in place, by dot products; a prefill tile's many
// rows take a tile of kTileKeys keys gathered across blocks, by two small matrix products, a
// register tile of rows at a time (flash attention's inner loop).
// Vectors are ATen's at::vec::Vectorized<float>, 16 floats with AVX512, 8 with AVX2.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace minivllm_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunkKeys = 16;  // a decode's chunk: keys of one block, read in place

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
// last vectors and dimensions go one at a time. (Named variables: an accumulator must have a fixed
// name or index for the compiler to keep it in a register; the tile products below get the same
// from arrays in completely unrolled loops.)
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

// `count` rows of `dim` values, `stride` apart, copied as float32 into dense rows at `dst`.
template <typename T>
inline void widen_rows(const T* rows, int64_t count, int64_t stride, int64_t dim, float* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const T* src = rows + j * stride;
    float* row = dst + j * dim;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(row, src, dim * sizeof(float));
    } else {
      int64_t d = 0;
      for (; d + Vec::size() <= dim; d += Vec::size()) {
        Vec widened;
        at::vec::load_to_float(src + d, widened);
        widened.store(row + d);
      }
      for (; d < dim; ++d) row[d] = static_cast<float>(src[d]);
    }
  }
}

template <typename T>
inline FloatRows as_float(const T* rows, int64_t count, int64_t stride, int64_t dim,
                          float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return {rows, stride};
  } else {
    widen_rows(rows, count, stride, dim, scratch);
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
// place of the scores (vectorized), the old sum rescaled once. Returns the factor by which the
// row's weighted values so far must be rescaled (the values themselves are the caller's).
inline float fold_scores(float* scores, int64_t count, RunningSoftmax& state) {
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
  return rescale;
}

// A decode row's whole update over one chunk: the softmax, then the weighted values into acc.
inline void update_row(float* scores, int64_t count, const FloatRows& values, int64_t dim,
                       RunningSoftmax& state, float* acc) {
  const float rescale = fold_scores(scores, count, state);
  add_weighted_values(acc, rescale, scores, values.data, values.stride, count, dim);
}

// Many rows against one tile of keys (a prefill tile): two small matrix products. The tile's
// keys are transposed into `kt` ([dim][kTileKeys]), so that a row's scores over the tile are
// kTileVecs vectors: the sum over d of q[d] * kt[d]. Its values lie in `vt` ([keys][dim]). Rows
// go kTileRows at a time, a register tile of rows x 4 vectors: each vector of keys or values
// loaded serves every row of the tile (with AVX512's 32 vector registers, four rows: loads are a
// quarter of the multiply-adds, and sixteen independent chains keep the vector units busy; AVX2
// has 16 registers, room for two rows).
constexpr int64_t kTileVecs = 4;
constexpr int64_t kTileKeys = kTileVecs * Vec::size();  // 64 with AVX512, 32 with AVX2
constexpr int kTileRows = Vec::size() >= 16 ? 4 : 2;
constexpr int64_t kMinTileRows = 8;  // fewer rows than this do not repay a tile's gathering

// The loops over a register tile's rows and vectors are unrolled completely, so that every
// accumulator has a fixed index and the compiler keeps it in a register.
#define UNROLLED _Pragma("GCC unroll 16")

// Scores of kTileRows rows (queries q[r]) against the whole tile, into s[r] (kTileKeys floats
// each). Fewer rows at the end: repeat the last one (its stores then write the same numbers).
inline void tile_scores(const float* const* q, int64_t dim, const float* kt, float* const* s) {
  constexpr int64_t V = Vec::size();
  Vec a[kTileRows][kTileVecs];
  UNROLLED for (int r = 0; r < kTileRows; ++r)
    UNROLLED for (int v = 0; v < kTileVecs; ++v) a[r][v] = Vec(0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    Vec k[kTileVecs];
    UNROLLED for (int v = 0; v < kTileVecs; ++v) k[v] = Vec::loadu(kt + d * kTileKeys + v * V);
    UNROLLED for (int r = 0; r < kTileRows; ++r) {
      const Vec x(q[r][d]);
      UNROLLED for (int v = 0; v < kTileVecs; ++v) a[r][v] = at::vec::fmadd(x, k[v], a[r][v]);
    }
  }
  UNROLLED for (int r = 0; r < kTileRows; ++r)
    UNROLLED for (int v = 0; v < kTileVecs; ++v) a[r][v].store(s[r] + v * V);
}

// acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v_j for kTileRows rows, over `count` value rows
// of `vt`: four vectors of each row's acc in registers, each loaded value vector used by all rows.
inline void tile_values(float* const* acc, const float* rescale, const float* const* p,
                        const float* vt, int64_t count, int64_t dim) {
  constexpr int64_t V = Vec::size();
  int64_t d = 0;
  for (; d + 4 * V <= dim; d += 4 * V) {
    Vec a[kTileRows][4];
    UNROLLED for (int r = 0; r < kTileRows; ++r)
      UNROLLED for (int v = 0; v < 4; ++v) a[r][v] = Vec::loadu(acc[r] + d + v * V) * Vec(rescale[r]);
    for (int64_t j = 0; j < count; ++j) {
      Vec x[4];
      UNROLLED for (int v = 0; v < 4; ++v) x[v] = Vec::loadu(vt + j * dim + d + v * V);
      UNROLLED for (int r = 0; r < kTileRows; ++r) {
        const Vec w(p[r][j]);
        UNROLLED for (int v = 0; v < 4; ++v) a[r][v] = at::vec::fmadd(w, x[v], a[r][v]);
      }
    }
    UNROLLED for (int r = 0; r < kTileRows; ++r)
      UNROLLED for (int v = 0; v < 4; ++v) a[r][v].store(acc[r] + d + v * V);
  }
  if (d < dim)  // head sizes that are not a multiple of four vectors (80, 96): the rest by rows
    for (int r = 0; r < kTileRows; ++r)
      add_weighted_values(acc[r] + d, rescale[r], p[r], vt + d, dim, count, dim - d);
}

}  // namespace minivllm_cpu
