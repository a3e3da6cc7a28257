"""Chapter 11's solutions: padding a decode step to its CUDA-graph bucket, and the block
tables of a padded step."""

import torch


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


def fill_block_tables(buffer, block_tables, size, padding_block):
    for row, table in enumerate(block_tables):
        # The whole table: when requests finish, the rows move up, so this row may hold
        # another sequence than it did at the last step.
        buffer[row, : len(table)] = torch.tensor(table, dtype=buffer.dtype)
    # A padding row attends over one token, its table's first entry: the padding block.
    buffer[len(block_tables) : size, 0] = padding_block
