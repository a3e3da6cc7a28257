"""The baselines the engine is measured against: chapter 01's loop without a cache and chapter
02's contiguous KV cache with static batching."""
