// Chapter 06, "The same kernel on a CPU": one work item, attended by one thread. An item is a
// sequence's slice of query rows for one K/V head over a range of its keys (paged_attention.cpp
// says how the step is cut into items). Its keys are read through the sequence's block table where
// they lie in the pool: a decode's few rows go over them a chunk of one block at a time, row by
// row; a prefill tile's many rows go a tile of keys at a time, gathered across blocks, by matrix
// products. The arithmetic inside a chunk or a tile is attention_tiles.h's.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_tiles.h"

namespace minivllm_cpu {

struct Pool {  // where K/V of (block, offset, head) lie: [2, blocks, block_size, kv_heads, dim]
  int64_t num_blocks, block_size, num_kv_heads, dim;
  int64_t token_stride() const { return num_kv_heads * dim; }
  int64_t half_stride() const { return num_blocks * block_size * token_stride(); }
};

// Where one work item's keys lie: K of position `pos` of its sequence, for its K/V head (V is
// half the pool further on).
template <typename T>
struct ItemKeys {
  const T* kv;
  const int32_t* block_table;
  const Pool& pool;
  int64_t kv_head;
  const T* key_row(int64_t pos) const {
    const int64_t block = block_table[pos / pool.block_size];
    const int64_t slot = block * pool.block_size + pos % pool.block_size;
    return kv + slot * pool.token_stride() + kv_head * pool.dim;
  }
};

// One work item's query rows and their running state. Rows are (query token, query head of the
// group); row r sits at position first_position + r / group and sees keys up to there (the causal
// mask shifted by the sequence's cached tokens).
struct ItemRows {
  const float* queries;  // [num_rows][dim], pre-multiplied by the softmax scale
  float* acc;            // [num_rows][dim], the unnormalized outputs
  RunningSoftmax* state;
  int64_t num_rows, group, first_position, dim;
  // How many of the `count` keys from position `begin` on row r sees (0 or less: none).
  int64_t visible(int64_t row, int64_t begin, int64_t count) const {
    return std::min(count, first_position + row / group - begin + 1);
  }
};

// Ask for the K and V rows of keys [begin, end) to be brought into L2 while the current chunk is
// computed. A decode's keys lie in blocks scattered over the pool, and the hardware prefetcher,
// which follows a stream of lines within one 4 KB page, cannot guess the next block; the block
// table knows it. One chunk ahead is enough: a chunk's arithmetic takes about as long as memory
// takes to answer. Into L2, not L1: measured on a 64-sequence decode, prefetching into L1 (or
// non-temporally) gained nothing, into L2 it cut the time by a third in float32 and by half in
// bfloat16. (Inlined by force: GCC judges a function whose only work is
// prefetching to have no effect and deletes its calls; built without, the kernel held no
// prefetch instruction at all.)
template <typename T>
[[gnu::always_inline]] inline void prefetch_rows(const ItemKeys<T>& keys, int64_t begin,
                                                  int64_t end) {
  constexpr int kCacheLine = 64, kRead = 0, kIntoL2 = 2;
  const int64_t row_bytes = keys.pool.dim * sizeof(T);
  for (int64_t pos = begin; pos < end; ++pos) {
    const char* k = reinterpret_cast<const char*>(keys.key_row(pos));
    const char* v = k + keys.pool.half_stride() * sizeof(T);
    for (int64_t byte = 0; byte < row_bytes; byte += kCacheLine) {
      __builtin_prefetch(k + byte, kRead, kIntoL2);
      __builtin_prefetch(v + byte, kRead, kIntoL2);
    }
  }
}

// A decode's few rows: chunks of at most kChunkKeys keys within one block (one block-table lookup),
// read where they lie, each row's scores by dot products.
template <typename T>
void attend_rows(const ItemKeys<T>& keys, const ItemRows& rows, int64_t key_begin,
                 int64_t last_key) {
  const Pool& pool = keys.pool;
  const int64_t dim = pool.dim, stride = pool.token_stride();
  std::vector<float> k_scratch(kChunkKeys * dim), v_scratch(kChunkKeys * dim), scores(kChunkKeys);
  for (int64_t chunk_begin = key_begin, chunk_end; chunk_begin < last_key; chunk_begin = chunk_end) {
    chunk_end = std::min({last_key, chunk_begin + kChunkKeys,
                          (chunk_begin / pool.block_size + 1) * pool.block_size});
    const int64_t count = chunk_end - chunk_begin;
    const T* k_rows = keys.key_row(chunk_begin);
    prefetch_rows(keys, chunk_end, std::min(last_key, chunk_end + kChunkKeys));
    const FloatRows k = as_float(k_rows, count, stride, dim, k_scratch.data());
    const FloatRows v = as_float(k_rows + pool.half_stride(), count, stride, dim, v_scratch.data());
    for (int64_t row = 0; row < rows.num_rows; ++row) {
      const int64_t visible = rows.visible(row, chunk_begin, count);
      if (visible <= 0) continue;
      dot_keys(rows.queries + row * dim, k.data, k.stride, visible, dim, scores.data());
      update_row(scores.data(), visible, v, dim, rows.state[row], rows.acc + row * dim);
    }
  }
}

// The keys [begin, end) of a prefill tile as float32: K transposed into kt ([dim][kTileKeys]), V
// as rows into vt ([keys][dim]), one block's run of keys at a time.
template <typename T>
void gather_tile(const ItemKeys<T>& keys, int64_t begin, int64_t end, float* kt, float* vt,
                 float* scratch) {
  const Pool& pool = keys.pool;
  const int64_t dim = pool.dim, stride = pool.token_stride();
  for (int64_t run_begin = begin, run_end; run_begin < end; run_begin = run_end) {
    run_end = std::min(end, (run_begin / pool.block_size + 1) * pool.block_size);
    const int64_t count = run_end - run_begin, column = run_begin - begin;
    const T* k_rows = keys.key_row(run_begin);
    const FloatRows k = as_float(k_rows, count, stride, dim, scratch);
    at::vec::transpose_mxn<float>(k.data, k.stride, kt + column, kTileKeys, count, dim);
    widen_rows(k_rows + pool.half_stride(), count, stride, dim, vt + column * dim);
  }
}

// A prefill tile's many rows: tiles of kTileKeys keys across blocks, gathered once for all rows,
// then per tile the scores (a matrix product), each row's softmax, and the weighted values (a
// second matrix product), kTileRows rows at a time. Rows are in position order, so the rows that see
// none of a tile (it lies in their future) are the first ones: they are skipped.
template <typename T>
void attend_tile(const ItemKeys<T>& keys, const ItemRows& rows, int64_t key_begin,
                 int64_t last_key) {
  const int64_t dim = rows.dim, num_rows = rows.num_rows;
  std::vector<float> kt(dim * kTileKeys, 0.0f), vt(kTileKeys * dim), scratch(kTileKeys * dim);
  std::vector<float> scores(num_rows * kTileKeys), rescales(num_rows);
  auto query = [&](int64_t row) { return rows.queries + row * dim; };
  auto acc = [&](int64_t row) { return rows.acc + row * dim; };
  auto p = [&](int64_t row) { return scores.data() + row * kTileKeys; };
  for (int64_t tile_begin = key_begin, tile_end; tile_begin < last_key; tile_begin = tile_end) {
    tile_end = std::min(last_key, tile_begin + kTileKeys);
    const int64_t count = tile_end - tile_begin;
    gather_tile(keys, tile_begin, tile_end, kt.data(), vt.data(), scratch.data());
    const int64_t first_row =
        std::clamp<int64_t>((tile_begin - rows.first_position) * rows.group, 0, num_rows);
    for (int64_t row = first_row; row < num_rows; row += kTileRows) {
      const float* q[kTileRows];
      float* s[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t each = std::min(row + r, num_rows - 1);  // past the end: the last row again
        q[r] = query(each), s[r] = p(each);
      }
      tile_scores(q, dim, kt.data(), s);
    }
    for (int64_t row = first_row; row < num_rows; ++row) {
      const int64_t visible = rows.visible(row, tile_begin, count);
      rescales[row] = fold_scores(p(row), visible, rows.state[row]);
      std::fill(p(row) + visible, p(row) + count, 0.0f);  // keys in its future weigh nothing
    }
    int64_t row = first_row;
    for (; row + kTileRows <= num_rows; row += kTileRows) {
      float* a[kTileRows];
      const float* w[kTileRows];
      for (int r = 0; r < kTileRows; ++r) a[r] = acc(row + r), w[r] = p(row + r);
      // the last row of a group sees at least as many keys as the others
      tile_values(a, rescales.data() + row, w, vt.data(),
                  rows.visible(row + kTileRows - 1, tile_begin, count), dim);
    }
    for (; row < num_rows; ++row)
      add_weighted_values(acc(row), rescales[row], p(row), vt.data(), dim,
                          rows.visible(row, tile_begin, count), dim);
  }
}

// Attend one work item: its query rows over its key range [key_begin, key_end), clipped to the
// keys its last row sees; a decode row by row, a prefill tile by matrix products.
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

  const ItemKeys<T> keys{kv, block_table, pool, kv_head};
  const ItemRows rows{queries.data(), acc.data(), state.data(), num_rows, group, first_position, dim};
  const int64_t last_key = std::min(key_end, first_position + (row_end - row_begin));
  if (num_rows >= kMinTileRows)
    attend_tile(keys, rows, key_begin, last_key);
  else
    attend_rows(keys, rows, key_begin, last_key);

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

}  // namespace minivllm_cpu
