"""The learning checks themselves are checked: each passes on minivllm's implementation and
fails, with a counterexample, on a typical learner's mistake."""

import pytest
import torch

from minivllm.learning_checks import all_checks, assert_check, run_check


def _layer_norm_instead_of_rms_norm(x, weight, eps):
    """Subtracts the mean: LayerNorm, not RMSNorm."""
    centered = x - x.mean(-1, keepdim=True)
    return centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_on_interleaved_pairs(x, positions, theta):
    """Rotates features (0,1), (2,3), ... (GPT-J style) where Llama pairs i with i + d/2."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _generate_ignoring_eos(model, prompt_token_ids, max_new_tokens, eos_token_id):
    """Forgets to stop at EOS."""
    from minivllm.baselines.naive import generate_without_cache

    return generate_without_cache(model, prompt_token_ids, max_new_tokens, eos_token_id=None)


def _kv_bytes_keys_only(num_layers, num_kv_heads, head_dim, dtype):
    """Counts the keys but not the values."""
    return num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _decode_attention_without_mask(q, keys, values, seq_lens):
    """Attends over every slot, including the empty ones past the row's length."""
    group = q.shape[1] // keys.shape[2]
    k = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [batch, heads, slots, dim]
    v = values.repeat_interleave(group, dim=2).transpose(1, 2)
    weights = torch.softmax((k @ q[..., None])[..., 0] / q.shape[-1] ** 0.5, dim=-1)
    return (weights[:, :, None, :] @ v)[:, :, 0, :]


def _slot_mapping_without_block_size(block_table, block_size, start, end):
    """Adds the offset to the block id instead of to the block's first slot."""
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def _paged_attention_causal_from_the_top(q, kv, block_tables, seq_lens, query_lens):
    """Gathers the right blocks but aligns the causal mask top-left: a chunk's first query
    sees only key 0 instead of every cached token before it."""
    out, start = [], 0
    for table, seq_len, query_len in zip(block_tables, seq_lens, query_lens):
        keys = kv[0, table].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = kv[1, table].flatten(0, 1)[:seq_len].transpose(0, 1)
        queries = q[start : start + query_len].transpose(0, 1)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        )
        start += query_len
    return torch.cat(out)


def _schedule_step_seats_ignore_running(running, waiting, budget, max_num_seqs):
    """Admits up to max_num_seqs waiting requests, forgetting the seats the running ones hold."""
    got_running, got_waiting = [], []
    for remaining in running:
        grant = min(remaining, budget)
        got_running.append(grant)
        budget -= grant
    for prompt_len in waiting:
        seats_left = max_num_seqs - sum(g > 0 for g in got_waiting)
        grant = min(prompt_len, budget) if seats_left > 0 else 0
        got_waiting.append(grant)
        budget -= grant
    return got_running, got_waiting


def _prepare_inputs_decode_one_position_ahead(
    token_ids, num_computed, num_scheduled, block_tables, block_size
):
    """Lays the batch out right, but gives a decode token position num_computed + 1 (the
    length of the sequence) instead of num_computed: RoPE would turn it one step too far."""
    input_ids, positions, slots, sample_rows = [], [], [], []
    for tokens, start, count, table in zip(token_ids, num_computed, num_scheduled, block_tables):
        end = start + count
        input_ids += tokens[start:end]
        shift = 1 if count == 1 and start > 0 else 0
        positions += [p + shift for p in range(start, end)]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        if end == len(tokens):
            sample_rows.append(len(input_ids) - 1)
    return input_ids, positions, slots, sample_rows


def _schedule_admitting_after_preemption(
    running, waiting, budget, max_num_seqs, num_blocks, block_size
):
    """Preempts the newest running request when the pool runs out, as it should, but then goes
    on to admit waiting requests in the same step (often the victim's own blocks go to them)."""

    def blocks(num_tokens):
        return -(-num_tokens // block_size)

    held = [blocks(computed) for computed, _ in running]
    free = num_blocks - sum(held)
    kept, preempted = list(range(len(running))), []
    got_running, got_waiting = [0] * len(running), [0] * len(waiting)
    index = 0
    while index < len(kept) and budget > 0:
        request = kept[index]
        computed, remaining = running[request]
        grant = min(remaining, budget)
        extra = blocks(computed + grant) - held[request]
        while extra > free and request not in preempted:
            victim = kept.pop()
            preempted.append(victim)
            free += held[victim]
            held[victim] = 0
        if request in preempted:
            break
        free -= extra
        held[request] += extra
        got_running[request] = grant
        budget -= grant
        index += 1
    seats = max_num_seqs - len(kept)
    for j, prompt_len in enumerate(waiting):  # the mistake: no `if preempted: stop` before
        grant = min(prompt_len, budget)
        if grant == 0 or seats == 0 or blocks(grant) > free:
            break
        got_waiting[j] = grant
        free -= blocks(grant)
        budget -= grant
        seats -= 1
    return got_running, got_waiting, preempted, free


def _block_hashes_without_chain(token_ids, block_size, salt):
    """Hashes each block's own tokens (and the salt), forgetting the blocks before it: two
    prompts that differ early but share a later block would share that block's K/V."""
    import hashlib

    return [
        hashlib.sha256(repr((salt, token_ids[i : i + block_size])).encode()).digest()
        for i in range(0, len(token_ids) - block_size + 1, block_size)
    ]


def _cached_prefix_length_without_last_token(block_hashes, cached, num_tokens, block_size):
    """Serves every leading cached block, even when that covers the whole prompt: no token is
    left to compute, so there are no logits to sample the first output token from."""
    num_cached = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        num_cached += 1
    return num_cached * block_size


BROKEN = {
    "ch00.rms_norm": _layer_norm_instead_of_rms_norm,
    "ch00.rope": _rope_on_interleaved_pairs,
    "ch01.generate_without_cache": _generate_ignoring_eos,
    "ch02.kv_bytes_per_token": _kv_bytes_keys_only,
    "ch02.decode_attention": _decode_attention_without_mask,
    "ch03.slot_mapping": _slot_mapping_without_block_size,
    "ch03.paged_attention": _paged_attention_causal_from_the_top,
    "ch04.schedule_step": _schedule_step_seats_ignore_running,
    "ch04.prepare_inputs": _prepare_inputs_decode_one_position_ahead,
    "ch04.schedule_with_preemption": _schedule_admitting_after_preemption,
    "ch05.block_hashes": _block_hashes_without_chain,
    "ch05.cached_prefix_length": _cached_prefix_length_without_last_token,
}


def test_every_check_has_a_broken_example():
    """Each registered check is exercised below with a wrong implementation."""
    assert set(all_checks()) == set(BROKEN)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_passes_on_minivllm(name):
    """minivllm's own implementation passes its chapter's check."""
    assert_check(name, all_checks()[name].reference())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_fails_on_a_typical_mistake(name):
    """A typical mistake fails, and the report shows a minimal failing input."""
    result = run_check(name, BROKEN[name])
    assert not result.passed
    assert "Falsifying example" in result.report or "Failing test case" in result.report
    assert "FAIL" in str(result)
