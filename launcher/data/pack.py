"""Which samples share a ``seq_len`` block, and which blocks share a micro-batch: pure functions of sample lengths.

Padding-free instruction batches keep every optimizer step's samples (those :mod:`.order` gives it, whatever
the packing) and only lay them out differently: a rank's samples of one step are packed first-fit-decreasing
into blocks of at most ``seq_len`` tokens, and the blocks are dealt to the step's micro-batches, each at least
one block and at most ``micro_batch`` blocks (what the planner planned: ``micro_batch`` rows of ``seq_len``).
The loss of a step is then the same sum over the same tokens as the padded run's (the loop divides it by the
step's count of tokens in the loss), so packing changes the speed, not the loss curve.

With a micro-batch of 1 every micro-batch still needs its own forward, so packing saves only the padding of
each row; the gain grows with the micro-batch.
"""

from __future__ import annotations


def pack_blocks(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped into blocks of at most ``seq_len`` tokens, first-fit decreasing.

    Deterministic: ties keep the original order. Each length must be <= seq_len (samples are cut before).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                blocks[b].append(i)
                free[b] -= n
                break
        else:
            blocks.append([i])
            free.append(seq_len - n)
    return blocks


def split_to(blocks: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """At least ``count`` blocks: the block holding the most samples is split in two until there are enough (every
    micro-batch of a step needs a row). ``count`` must not exceed the number of samples."""
    blocks = [list(b) for b in blocks]
    while len(blocks) < count:
        k = max(range(len(blocks)), key=lambda j: (len(blocks[j]), -j))
        b = blocks[k]
        if len(b) < 2:
            raise ValueError(f"cannot make {count} blocks from {sum(len(x) for x in blocks)} samples")
        half = len(b) // 2
        blocks[k], extra = b[:half], b[half:]
        blocks.append(extra)
    return blocks


def deal(blocks: list[list[int]], lengths: list[int], count: int) -> list[list[list[int]]]:
    """``count`` micro-batches of blocks: longest blocks first, dealt round-robin, so every micro-batch has
    ceil or floor of len(blocks) / count rows and similar lengths (the row length of a micro-batch is its longest)."""
    size = {id(b): sum(lengths[i] for i in b) for b in blocks}
    ranked = sorted(blocks, key=lambda b: -size[id(b)])
    out: list[list[list[int]]] = [[] for _ in range(count)]
    for j, b in enumerate(ranked):
        out[j % count].append(b)
    return out


def plan_step(lengths: list[int], seq_len: int, micro_batches: int) -> list[list[list[int]]]:
    """The micro-batches of one step on one rank: lists of blocks, each a list of positions into ``lengths``."""
    blocks = split_to(pack_blocks(lengths, seq_len), lengths, micro_batches)
    return deal(blocks, lengths, micro_batches)
