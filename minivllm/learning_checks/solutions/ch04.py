"""Solutions to chapter 04's exercises: one scheduling step's token-budget rule, the model
runner's flat batch, and a step that preempts when the KV pool runs out."""


def schedule_step(
    running: list[int], waiting: list[int], budget: int, max_num_seqs: int
) -> tuple[list[int], list[int]]:
    """Grants for one step with KV blocks to spare. running: tokens each running request still
    has to compute, in running order; waiting: prompt lengths in queue order. Returns the
    tokens granted to each (0: not scheduled)."""
    got_running = []
    for left in running:  # running requests first, in order, each as much as the budget allows
        grant = min(left, budget)
        got_running.append(grant)
        budget -= grant
    got_waiting = []
    seats = max_num_seqs - len(running)  # running requests hold their seats
    for prompt_len in waiting:  # then waiting ones in queue order; a prompt may get a chunk
        grant = min(prompt_len, budget) if seats > 0 else 0
        got_waiting.append(grant)
        budget -= grant
        if grant > 0:
            seats -= 1
    return got_running, got_waiting


def prepare_inputs(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The flat batch of one step: for each scheduled token, sequence after sequence, its id,
    its position and its pool slot; then the rows to sample from."""
    input_ids, positions, slot_mapping, sample_rows = [], [], [], []
    for tokens, computed, scheduled, table in zip(
        token_ids, num_computed, num_scheduled, block_tables
    ):
        # This step computes the tokens at positions computed .. computed + scheduled - 1 (a
        # decode: the one token at position computed, the newest).
        for position in range(computed, computed + scheduled):
            input_ids.append(tokens[position])
            positions.append(position)
            block_id = table[position // block_size]
            slot_mapping.append(block_id * block_size + position % block_size)
        # A sequence samples its next token only when this step reaches its last known token;
        # a prefill chunk that stops mid-prompt has nothing to sample yet.
        if computed + scheduled == len(tokens):
            sample_rows.append(len(input_ids) - 1)
    return input_ids, positions, slot_mapping, sample_rows


def schedule_with_preemption(
    running: list[tuple[int, int]],
    waiting: list[int],
    budget: int,
    max_num_seqs: int,
    num_blocks: int,
    block_size: int,
) -> tuple[list[int], list[int], list[int], int]:
    """One step with a KV pool of num_blocks blocks. running: (tokens computed, tokens still to
    compute) per running request, oldest admitted first; waiting: prompt lengths in queue
    order. Returns (grants to running, grants to waiting, preempted indices into running
    newest first, free blocks after the step)."""

    def blocks_for(num_tokens: int) -> int:
        return -(-num_tokens // block_size)  # ceil(num_tokens / block_size)

    held = [blocks_for(computed) for computed, _ in running]  # blocks each request holds
    free = num_blocks - sum(held)
    kept = list(range(len(running)))  # still running, oldest first; victims leave from the end
    got_running = [0] * len(running)
    preempted: list[int] = []

    # 1. Running requests, in order. One that needs more blocks than are free makes the newest
    #    running request give all of its blocks back, until it fits, or until it is itself the
    #    newest and is preempted.
    index = 0
    while index < len(kept) and budget > 0:
        request = kept[index]
        computed, remaining = running[request]
        grant = min(remaining, budget)
        needed = max(blocks_for(computed + grant) - held[request], 0)
        while needed > free and request in kept:
            victim = kept.pop()  # the newest (FCFS); never one already served this step
            preempted.append(victim)
            free += held[victim]
            held[victim] = 0
        if request not in kept:
            break  # it preempted itself: nothing after it is left running
        free -= needed
        held[request] += needed
        got_running[request] = grant
        budget -= grant
        index += 1

    # 2. Waiting requests in queue order, while budget, seats and blocks last; none at all
    #    after a preemption: the pool is short, admitting would only preempt again.
    got_waiting = [0] * len(waiting)
    seats = max_num_seqs - len(kept)
    if not preempted:
        for j, prompt_len in enumerate(waiting):
            grant = min(prompt_len, budget)
            if grant == 0 or seats == 0 or blocks_for(grant) > free:
                break  # strict queue order: nobody behind it jumps ahead
            got_waiting[j] = grant
            free -= blocks_for(grant)
            budget -= grant
            seats -= 1
    return got_running, got_waiting, preempted, free
