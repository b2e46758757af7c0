"""``bench codec``'s in-process parts on small layouts: exact bytes and session counts."""

import argparse

from cluster.cache.kv_pool import KVLayout
from lab.bench import codec_parts as bench

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)


def test_bytes_per_token_per_tier_and_codec():
    row = bench.bytes_part(LAYOUT, ["none", "int8"], 4)
    assert row["hot_bytes_per_token"] == 2 * 2 * 1 * 4 * 4
    assert row["none_warm_bytes_per_token"] == row["none_cold_bytes_per_token"] == 64
    assert row["int8_warm_bytes_per_token"] == row["int8_cold_bytes_per_token"] == 2 * 2 * 1 * 5
    assert row["int8_l3_bytes_per_token"] > 20 and row["int8_warm_vs_none"] == 3.2


def test_sessions_held_in_a_fixed_warm_budget_are_counted_whole():
    # 2-block sessions; 2,560 bytes of WARM: 10 float32 blocks (5 sessions), 32 int8 blocks (16).
    sessions = [[1000 + s] + list(range(7)) for s in range(20)]
    mb = 2560 / (1 << 20)
    none = bench.sessions_held(LAYOUT, "none", mb, sessions, 4)
    int8 = bench.sessions_held(LAYOUT, "int8", mb, sessions, 4)
    assert (none["warm_blocks"], none["sessions_held"]) == (10, 5)
    assert (int8["warm_blocks"], int8["sessions_held"]) == (32, 16)
    assert none["dropped_tokens"] == 15 * 8 and int8["dropped_tokens"] == 4 * 8


def test_the_sessions_workload_has_the_shape_of_issue_39():
    args = argparse.Namespace(seed=0, system_tokens=80, sessions=12, turns=4, doc_tokens=1300, max_tokens=96,
                              decode_tokens=8, arrival_s=4.0, think_s=3.0, long_pause_s=20.0, long_pause_share=0.25)
    work = bench.SessionsWorkload(args, 49152)
    assert len(work.system[0]) == 80 and work.group == [0] * 12
    assert [len(u[0]) for u in work.user] == [1314] * 12 and all(len(u[1]) == 14 for u in work.user)
    assert work.start[0] == 0.0 and work.start == sorted(work.start)
    assert all(16 <= n <= 96 for row in work.reply_len for n in row)
    assert work.total_tokens() == 80 + sum(1314 + 3 * 14 + sum(r) for r in work.reply_len)


def test_accuracy_and_greedy_compare_prefixes_promoted_from_warm():
    from cluster.engine.model import DecoderModel, ModelConfig

    model = DecoderModel(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                     intermediate_size=128, seed=3))
    text = [(i * 7) % 250 + 1 for i in range(3000)]
    args = argparse.Namespace(prefix_tokens=64, continuation_tokens=51, positions=100, block_tokens=16,
                              max_batch_tokens=512, greedy_prompts=3, prompt_tokens=40, greedy_tokens=6)
    row = bench.accuracy_part(model, text, ["none", "int8"], args)
    assert row["positions"] == 2 * 50   # two chunks of 50 predicted positions each
    assert 0 < row["int8_mean_abs_delta_logprob"] <= row["int8_max_abs_delta_logprob"] < 0.05
    row = bench.greedy_part(model, text, ["none", "int8"], args)
    assert row["prompts"] == 3 and 0 <= row["int8_prompts_agree"] <= 3
    assert row["int8_tokens_before_first_difference"] <= 3 * 6
