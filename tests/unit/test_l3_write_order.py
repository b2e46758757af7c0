"""L3 write behind for a session whose next turn may land elsewhere: a commit's
write goes to the front of the queue (behind only the queued writes of its own
chain), and a sequence's partial last block is written and read back, keyed by
its exact tokens and verified like any block. The tier alone, on an in-process
store, its I/O run here (no threads, no model)."""

import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3.memory import MemoryL3Store
from cluster.cache.l3.tier import L3Tier, L3TierConfig
from cluster.cache.l3.wire import L3Block
from cluster.hashing import block_hashes, tail_hash

BT = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")


class RecordingStore(MemoryL3Store):
    """Remembers the names of each put, in order."""

    def __init__(self):
        super().__init__()
        self.puts: list[list[str]] = []

    def put_blocks(self, blocks):
        self.puts.append([b.key.name for b in blocks])
        return super().put_blocks(blocks)


def make(store=None) -> L3Tier:
    return L3Tier(store or MemoryL3Store(), LAYOUT, BT, L3TierConfig(model_id="m"), start_thread=False)


def kv_of(tokens, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)


def write(tier, tokens, front, *, tail=False, seed=0):
    """Write what ``tier`` lacks of ``tokens``' full blocks (and its partial one with ``tail``)."""
    full = len(tokens) // BT * BT
    hashes = block_hashes(tokens[:full], BT)
    todo = tier.unwritten(hashes)
    kv = kv_of(tokens, seed)
    parts = [kv[:, :, i * BT:(i + 1) * BT] for i in todo] + ([kv[:, :, full:]] if tail else [])
    tail_h = tail_hash(hashes[-1], tokens[full:]) if tail else None
    return tier.write(tokens if tail else tokens[:full], hashes, todo, torch.cat(parts, dim=2), tail=tail_h,
                      front=front)


def names(tier, tokens, blocks):
    hashes = block_hashes(tokens, BT)
    return [tier.key(hashes[i]).name for i in blocks]


def test_a_commit_is_written_first_behind_only_its_own_chain():
    store = RecordingStore()
    tier = make(store)
    session = list(range(1, 9))                   # turn 1: blocks 0, 1
    other = list(range(100, 108))
    handoff = list(range(200, 208))
    later = session + list(range(9, 17))          # turn 2: blocks 2, 3 of the same chain
    assert write(tier, session, front=True) == 2
    assert write(tier, other, front=True) == 2    # a newer commit: ahead of the older one
    assert write(tier, handoff, front=False) == 2  # a hand-off write: behind everything
    assert write(tier, later, front=True) == 2    # its chain's earlier write first, then it
    assert tier.run_pending() == 4
    assert store.puts == [names(tier, session, [0, 1]), names(tier, later, [2, 3]),
                          names(tier, other, [0, 1]), names(tier, handoff, [0, 1])]


def test_a_partial_last_block_is_written_and_read_back_exactly():
    store = MemoryL3Store()
    writer, reader = make(store), make(store)
    seq = list(range(1, 12))                      # 2 full blocks and 3 tokens
    assert write(writer, seq, front=True, tail=True) == 3
    writer.run_pending()
    assert writer.take_written() == 2 and writer.stats.tails_written == 1
    hashes = block_hashes(seq, BT)
    tail = tail_hash(hashes[-1], seq[8:])
    assert store.num_values == 3 and writer.key(tail, 3).name.endswith(f"{tail:016x}-t3")
    assert sorted(writer._list_hashes()) == sorted(hashes)   # the inventory lists full blocks only

    nxt = seq + [50, 51, 52, 53, 54]              # the next turn, on another replica
    nxt_hashes = block_hashes(nxt, BT)
    reader.start_fetch(None, nxt, nxt_hashes, 0)
    reader.run_pending()
    (got,) = reader.take_fetched()
    assert (got.blocks, got.tail_tokens, got.tail_hash, got.tokens) == (2, 3, tail, seq)
    assert got.missing == [nxt_hashes[2]]         # the full block 2 is still not in L3
    assert torch.equal(got.kv, kv_of(seq))
    # Read from L3: neither its blocks nor its tail are written back by this replica.
    assert reader.stats.tails_fetched == 1 and tail in reader.written_tails
    assert reader.unwritten(hashes) == []


def test_a_partial_block_is_used_only_where_its_tokens_match_exactly():
    store = MemoryL3Store()
    writer, reader = make(store), make(store)
    seq = list(range(1, 12))
    write(writer, seq, front=True, tail=True)
    writer.run_pending()
    writer.take_written()
    hashes = block_hashes(seq, BT)
    # Another sequence after the same two blocks: its third token differs, so no key of
    # its lengths names the stored tail (one existence check, no read of a value).
    other = seq[:10] + [99, 7, 7]
    reader.start_fetch(None, other, block_hashes(other, BT), 0)
    reader.run_pending()
    (got,) = reader.take_fetched()
    assert (got.blocks, got.tail_tokens, got.tokens) == (2, 0, seq[:8])
    assert store.stats().hits == 2 and store.stats().token_mismatches == 0
    # A value of other tokens under a tail's key (a hash collision) is read, refused, unused.
    forged = [5, 6]
    key = writer.key(tail_hash(hashes[-1], forged), 2)
    store.put_blocks([L3Block(key, (9, 9), kv_of([0, 0]))])
    probe = seq[:8] + forged + [1, 1]
    reader.start_fetch(None, probe, block_hashes(probe, BT), 0)
    reader.run_pending()
    (got,) = reader.take_fetched()
    assert (got.blocks, got.tail_tokens, got.tokens) == (2, 0, seq[:8])
    assert store.stats().token_mismatches == 1


def test_a_failed_or_dropped_partial_block_is_not_believed_written():
    store = MemoryL3Store()
    store.close()                                 # every put fails
    tier = make(store)
    seq = list(range(1, 12))
    tail = tail_hash(block_hashes(seq, BT)[-1], seq[8:])
    assert write(tier, seq, front=True, tail=True) == 3 and tail in tier.written_tails
    tier.run_pending()
    tier.take_written()
    assert tail not in tier.written_tails and tier.stats.write_failures == 3
    assert write(tier, seq, front=True, tail=True) == 3
    assert tier.drop_queued_writes() == 3 and tail not in tier.written_tails
