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
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "work_item.h"

namespace {

using namespace minivllm_cpu;  // attend_item (work_item.h) and the arithmetic it uses
constexpr int kWorkFields = 8;

// The pool's dtypes: float32, and ATen's 16-bit ones (bfloat16, float16), widened to compute.
#define DISPATCH_CASE_POOL_DTYPES(...) \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE_REDUCED_FLOATING_TYPES(__VA_ARGS__)

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

  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention", DISPATCH_CASE_POOL_DTYPES([&] {
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
