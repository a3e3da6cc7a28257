"""Chapter 11's solution: padding a decode step to its CUDA-graph bucket."""


def pad_decode_step(slot_mapping, seq_lens, sizes, padding_block, block_size):
    fitting = [size for size in sizes if size >= len(seq_lens)]
    if not fitting:  # more rows than the largest graph: run without one
        return None, list(slot_mapping), list(seq_lens)
    bucket = min(fitting)
    padding = bucket - len(seq_lens)
    # A padding row writes its K/V into the first slot of the padding block, which no request
    # owns, and attends over that one token.
    return (
        bucket,
        list(slot_mapping) + [padding_block * block_size] * padding,
        list(seq_lens) + [1] * padding,
    )
