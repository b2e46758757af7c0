"""`bench serving --workload sessions`: the schedule, the client, the vLLM arms and the summary.

Nothing here is timed: the schedule is a pure function of its seed (``plan_sessions``), the
client runs against a fake OpenAI-compatible streaming server on 127.0.0.1 with every pause
zero, and the arms are stand-ins where the bench itself is under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import pytest

from lab.bench import serving as bench_serving
from lab.load.chat_workload import Turn, turn_records
from lab.load.session_workload import (
    SESSION_HEADER,
    PlannedSession,
    distinct_questions,
    plan_sessions,
    run_sessions,
    session_fields,
)


class Words:
    """A tokenizer of one token a word: sizes are exact and fast."""

    def encode(self, text: str) -> list[str]:
        return text.split()


def plan(**overrides) -> list[PlannedSession]:
    params = dict(sessions=12, turns=4, doc_tokens=300, arrival_s=4.0, think_s=3.0, long_pause_share=0.25,
                  long_pause_s=20.0, max_tokens=96, seed=0)
    return plan_sessions(Words(), **{**params, **overrides})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bench_serving.add_arguments(p)
    return p


# ------------------------------------------------------------------ the schedule
def test_the_schedule_is_a_pure_function_of_the_seed() -> None:
    assert plan(seed=7) == plan(seed=7)
    other = plan(seed=8)
    assert [s.start_s for s in other] != [s.start_s for s in plan(seed=7)]
    assert {s.document for s in other}.isdisjoint({s.document for s in plan(seed=7)})
    # Each concern draws from its own stream: longer pauses move no arrival, question or document.
    a, b = plan(long_pause_s=20.0), plan(long_pause_s=40.0)
    assert [s.start_s for s in a] == [s.start_s for s in b] and [s.document for s in a] == [s.document for s in b]
    assert [t.question for s in a for t in s.turns] == [t.question for s in b for t in s.turns]
    assert [t.after_long_pause for s in a for t in s.turns] == [t.after_long_pause for s in b for t in s.turns]
    assert [t.pause_s * 2 for s in a for t in s.turns if t.after_long_pause] == \
        pytest.approx([t.pause_s for s in b for t in s.turns if t.after_long_pause])


def test_questions_never_repeat_and_documents_are_each_sessions_own() -> None:
    sessions = plan(sessions=40, turns=10)
    questions = [t.question for s in sessions for t in s.turns]
    assert len(questions) == 400 and len(set(questions)) == 400
    assert len(set(distinct_questions(5000, __import__("random").Random(1)))) == 5000   # past the easy draws
    docs = [s.document for s in sessions]
    assert len(set(docs)) == 40
    assert all(len(d.split()) == 300 for d in docs)   # sized with the tokenizer: exactly, at one token a word
    assert len({" ".join(d.split()[:2]) for d in docs}) == 40   # they differ from their first words on
    assert [s.session_id for s in sessions[:3]] == ["session-0-000", "session-0-001", "session-0-002"]
    first = sessions[0]
    assert first.first_message(first.turns[0]).startswith("Here is a document.\n\n" + first.document)
    assert first.first_message(first.turns[0]).endswith(first.turns[0].question)


def test_arrivals_and_pauses_follow_the_parameters() -> None:
    sessions = plan(sessions=2000, turns=5, doc_tokens=8, arrival_s=4.0, think_s=3.0, long_pause_share=0.25,
                    long_pause_s=20.0)
    starts = [s.start_s for s in sessions]
    assert starts[0] == 0.0 and starts == sorted(starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert statistics.mean(gaps) == pytest.approx(4.0, rel=0.1)
    assert statistics.median(gaps) == pytest.approx(4.0 * 0.693, rel=0.1)   # exponential, not fixed
    firsts = [s.turns[0] for s in sessions]
    assert all(t.turn == 0 and t.pause_s == 0.0 and not t.after_long_pause for t in firsts)
    later = [t for s in sessions for t in s.turns[1:]]
    long = [t.pause_s for t in later if t.after_long_pause]
    short = [t.pause_s for t in later if not t.after_long_pause]
    assert len(long) / len(later) == pytest.approx(0.25, abs=0.02)
    assert statistics.mean(long) == pytest.approx(20.0, rel=0.1)
    assert statistics.mean(short) == pytest.approx(3.0, rel=0.1)
    lengths = [t.max_tokens for s in sessions for t in s.turns]
    assert min(lengths) == 16 and max(lengths) == 96   # drawn over the whole range, both ends included
    # The edges: no long pause at all, every pause long, no wait at all, a bound below 16.
    assert not any(t.after_long_pause for s in plan(long_pause_share=0.0) for t in s.turns)
    assert all(t.after_long_pause for s in plan(long_pause_share=1.0) for t in s.turns[1:])
    still = plan(arrival_s=0.0, think_s=0.0, long_pause_s=0.0)
    assert {s.start_s for s in still} == {0.0} and {t.pause_s for s in still for t in s.turns} == {0.0}
    assert {t.max_tokens for s in plan(max_tokens=8) for t in s.turns} == {8}
    with pytest.raises(ValueError):
        plan(long_pause_share=1.5)


def test_later_turns_and_long_pauses_are_classified_from_the_turns() -> None:
    def turn(session, t, ttft_s, prompt, cached, long=False, ok=True):
        out = Turn(session, t, ok, ttft_s if ok else None, 1.0, prompt, 8, cached, None if ok else "HTTP 503")
        out.after_long_pause = long
        return out

    turns = [turn(0, 0, 0.9, 1000, 0), turn(1, 0, 1.1, 1000, 64),
             turn(0, 1, 0.10, 1100, 1000), turn(0, 2, 0.50, 1200, 900, long=True),
             turn(1, 1, 0.20, 1100, 1100, long=True), turn(1, 2, 9.0, 1300, 0, ok=False)]
    row = session_fields(turns)
    assert row["later_turns_cached_share"] == round(3000 / 3400, 4)   # the failed turn counts nowhere
    assert (row["ttft_ms_first_turn_p50"], row["ttft_ms_first_turn_p99"]) == (900.0, 1100.0)
    assert (row["ttft_ms_later_turns_p50"], row["ttft_ms_later_turns_p99"]) == (200.0, 500.0)
    assert (row["ttft_ms_after_long_pause_p50"], row["ttft_ms_after_long_pause_p99"]) == (200.0, 500.0)
    assert row["long_pause_turns"] == 2
    none = session_fields([turn(0, 0, 0.9, 1000, 0)])
    assert none["later_turns_cached_share"] is None and none["ttft_ms_after_long_pause_p50"] is None


# ------------------------------------------------------------ the client, end to end
class FakeServer:
    """An OpenAI-compatible streaming chat server on 127.0.0.1 (aiohttp) that answers each turn
    with a reply naming its session and turn, and records every request's headers and body."""

    def __init__(self, fail=None, cut=None):
        self.requests: list[tuple[dict, dict]] = []
        self.fail, self.cut = fail or set(), cut or set()   # (session id, turn) -> HTTP 500 / no [DONE]

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(({k.lower(): v for k, v in request.headers.items()}, body))
        sid = request.headers.get(SESSION_HEADER, "anonymous")
        turn = sum(1 for m in body["messages"] if m["role"] == "user") - 1
        if (sid, turn) in self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (f"reply of {sid}", f" to turn {turn}."):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if (sid, turn) not in self.cut:
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            usage = {"prompt_tokens": prompt, "completion_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": prompt // 2 if turn else 0}}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def run(self, sessions, **kwargs):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = runner.addresses[0][1]
            return await run_sessions(f"http://127.0.0.1:{port}", "m", sessions, system="Be brief.", **kwargs)
        finally:
            await runner.cleanup()


def test_the_client_sends_each_sessions_header_and_its_real_replies_back() -> None:
    pytest.importorskip("aiohttp")
    sessions = plan(sessions=3, turns=3, doc_tokens=40, arrival_s=0.0, think_s=0.0, long_pause_s=0.0)
    server = FakeServer()
    result = asyncio.run(server.run(sessions))
    assert len(result.turns) == 9 and all(t.ok for t in result.turns)
    assert len(server.requests) == 9
    for headers, body in server.requests:
        sid = headers[SESSION_HEADER.lower()]
        s = next(s for s in sessions if s.session_id == sid)
        messages = body["messages"]
        turn = len(messages) // 2 - 1   # system, then a user (and assistant) message a turn
        assert messages[0] == {"role": "system", "content": "Be brief."}
        assert messages[1] == {"role": "user", "content": s.first_message(s.turns[0])}
        for t in range(turn):   # every earlier turn: its question and the server's real reply
            assert messages[2 + 2 * t] == {"role": "assistant", "content": f"reply of {sid} to turn {t}."}
            assert messages[3 + 2 * t] == {"role": "user", "content": s.turns[t + 1].question}
        assert body["max_tokens"] == s.turns[turn].max_tokens and body["temperature"] == 0.0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    row = result.summary()
    assert (row["requests"], row["failed"]) == (9, 0)
    later = [t for t in result.turns if t.turn > 0]
    assert row["later_turns_cached_share"] == round(sum(t.prompt_tokens // 2 for t in later) /
                                                    sum(t.prompt_tokens for t in later), 4)
    # --no-session-header: no request carries one.
    server = FakeServer()
    asyncio.run(server.run(sessions, session_header=False))
    assert len(server.requests) == 9
    assert not any(SESSION_HEADER.lower() in headers for headers, _ in server.requests)
    # bench serving --temperature 0.8 --top-p 0.95: every request samples so.
    server = FakeServer()
    asyncio.run(server.run(sessions, sampling={"temperature": 0.8, "top_p": 0.95}))
    assert len(server.requests) == 9
    assert all((body["temperature"], body["top_p"]) == (0.8, 0.95) for _, body in server.requests)


def test_bench_serving_samples_as_told_and_greedy_by_default() -> None:
    from types import SimpleNamespace

    from lab.bench.serving import sampling_of

    assert sampling_of(SimpleNamespace(temperature=0.0, top_p=1.0)) == {"temperature": 0.0}
    assert sampling_of(SimpleNamespace(temperature=0.8, top_p=0.95)) == {"temperature": 0.8, "top_p": 0.95}
    for bad in ((-1.0, 1.0), (0.8, 0.0), (0.8, 1.5), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="--temperature must be >= 0 and --top-p in"):
            sampling_of(SimpleNamespace(temperature=bad[0], top_p=bad[1]))


def test_an_error_status_or_a_stream_without_its_end_fails_the_turn_and_ends_its_session() -> None:
    pytest.importorskip("aiohttp")
    sessions = plan(sessions=3, turns=3, doc_tokens=40, arrival_s=0.0, think_s=0.0, long_pause_s=0.0)
    server = FakeServer(fail={("session-0-000", 1)}, cut={("session-0-002", 0)})
    result = asyncio.run(server.run(sessions))
    by_session = {s: sorted((t.turn, t.ok) for t in result.turns if t.session == s) for s in range(3)}
    assert by_session == {0: [(0, True), (1, False)], 1: [(0, True), (1, True), (2, True)], 2: [(0, False)]}
    assert len(server.requests) == 6   # nothing sent after a failure
    row = result.summary()
    assert (row["requests"], row["failed"]) == (6, 2)


# ------------------------------------------------------------------ the vLLM arms
def test_vllm_runs_in_its_default_mode_with_our_step_limits_and_each_arms_kv(vllm_venv) -> None:
    python, model = vllm_venv
    block_bytes = 2 * 2 * 2 * 16 * 32 * 4   # layers x (K, V) x kv heads x head dim x 32 tokens x float32

    def command(arm, *flags):
        args = bench_serving.resolve_defaults(parser().parse_args(["--peer", "vllm", "--peer-python", str(python),
                                                                   *flags]))
        cmd, _ = bench_serving._vllm_command(args, model, bench_serving.vllm_kv_tokens(args, arm, args.hot_tokens),
                                             8000)
        return cmd, (lambda flag: cmd[cmd.index(flag) + 1])

    for arm, blocks in (("vllm-same-hot", 4096 // 32 + 1), ("vllm-all-memory", (4096 + 65536) // 32 + 1)):
        cmd, value = command(arm)
        assert "--enforce-eager" not in cmd   # vLLM-CPU's default mode compiles
        assert (value("--max-num-batched-tokens"), value("--max-num-seqs")) == ("512", "64")   # our worker's
        assert value("--num-gpu-blocks-override") == str(blocks)
        assert value("--kv-cache-memory-bytes") == str(blocks * block_bytes)
        assert value("--max-model-len") == "4096"   # bounded as before
    # Our limits move, vLLM's with them; WARM is per replica, so all-memory counts each replica's.
    _, value = command("vllm-same-hot", "--max-batch-tokens", "256")
    assert value("--max-num-batched-tokens") == "256"
    _, value = command("vllm-all-memory", "--replicas", "2", "--hot-tokens", "2048", "--warm-tokens", "8192")
    assert value("--num-gpu-blocks-override") == str((2048 + 2 * 8192) // 32 + 1)
    _, value = command("vllm-same-hot", "--hot-tokens", "1000")
    assert (value("--num-gpu-blocks-override"), value("--max-model-len")) == (str(32 + 1), "1024")
    assert bench_serving.step_limits(parser().parse_args([])) == (512, 64)


def test_the_workload_picks_its_defaults_and_arms() -> None:
    sessions = bench_serving.resolve_defaults(parser().parse_args([]))
    assert (sessions.workload, sessions.sessions, sessions.turns, sessions.system_tokens, sessions.max_tokens,
            sessions.think_s, sessions.hot_tokens, sessions.warm_tokens) == \
        ("sessions", 12, 4, 80, 96, 3.0, 4096, 65536)
    assert (sessions.doc_tokens, sessions.arrival_s, sessions.long_pause_share, sessions.long_pause_s,
            sessions.session_header, sessions.l3) == (1300, 4.0, 0.25, 20.0, True, False)
    burst = bench_serving.resolve_defaults(parser().parse_args(["--workload", "burst"]))
    assert (burst.sessions, burst.turns, burst.system_tokens, burst.max_tokens, burst.think_s, burst.hot_tokens) == \
        (16, 6, 400, 24, 2.0, None)
    given = bench_serving.resolve_defaults(parser().parse_args(["--sessions", "3", "--no-session-header", "--l3"]))
    assert (given.sessions, given.turns, given.session_header, given.l3) == (3, 4, False, True)
    parse = bench_serving.parse_arms
    assert parse(None, "sessions") == ["prefix-cache", "vllm-same-hot", "vllm-all-memory"]
    assert parse(None, "burst") == ["prefix-cache", "vllm-same-hot"]
    assert parse("vllm-all-memory,vllm-cpu", "sessions") == ["vllm-same-hot", "vllm-all-memory"]
    with pytest.raises(ValueError, match="vllm-gpu"):
        parse("prefix-cache,vllm-gpu", "sessions")


def test_no_arm_always_runs_first_and_each_pair_is_followed_by_its_mirror() -> None:
    three = [bench_serving.arm_order(["a", "b", "c"], i) for i in range(7)]
    assert three == [list("abc"), list("cba"), list("bca"), list("acb"), list("cab"), list("bac"), list("abc")]
    assert {order[0] for order in three[:3]} == {"a", "b", "c"}
    for i in range(0, 6, 2):   # within each two pairs, every arm runs before each other arm once
        assert three[i + 1] == three[i][::-1]
    assert [bench_serving.arm_order(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert bench_serving.arm_order(["a"], 5) == ["a"]


# ------------------------------------------------------------------ rows and summary
def test_our_row_reads_the_replicas_stats() -> None:
    from cluster.names import TIER_NAMES

    assert bench_serving.DROPPED_TIERS == TIER_NAMES
    def worker(kernel, **cache):
        return {"engine": {"preemptions": 2, "recomputed_tokens": 30, "recomputed_held_tokens": 5, "steps": 4,
                           "step_ms": 400.0},
                "cache": {"promoted_tokens": 100, "dropped_tokens": 50, "dropped_events": 9, **cache},
                "worker": {"decode_kernel": kernel, "openmp": "intel", "malloc": "tcmalloc", "linear_layouts": {}}}

    stats = {"workers": {"w0": worker(True, dropped_warm_last_tier_tokens=20, dropped_hot_lower_full_tokens=10,
                                      dropped_with_room_tokens=10),
                         "w1": worker(True, dropped_cold_flush_tokens=20)}}
    row = bench_serving.our_stats(stats, wall_s=2.0)
    assert (row["preemptions"], row["promoted_tokens"], row["recomputed_tokens"]) == (4, 200, 60)
    assert (row["recomputed_held_tokens"], row["recompute_chosen_tokens"]) == (10, 0)   # absent stat: 0
    assert row["dropped_tokens_by_reason"] == {"warm/last_tier": 20, "hot/lower_full": 10, "cold/flush": 20,
                                               "dropped_tokens": 100}   # dropped_with_room_tokens is no tier's
    assert row["dropped_with_room_tokens"] == 10   # the caches' own count, as it is
    assert row["dropped_tokens"] == 100 and row["compiled_kernels"] is True
    assert row["engine_busy_share"] == 0.2   # 400 ms of steps a replica over 2 s
    # 10 tokens dropped for want of room, and 50 of the total no reason accounts for.
    assert bench_serving.dropped_for_other_reasons(row["dropped_tokens_by_reason"]) == 60
    assert bench_serving.dropped_for_other_reasons({"warm/last_tier": 5, "dropped_tokens": 5}) == 0
    stats["workers"]["w1"]["worker"]["decode_kernel"] = False
    assert bench_serving.our_stats(stats, 2.0)["compiled_kernels"] is False
    for w in stats["workers"].values():
        del w["worker"]["decode_kernel"]
    assert bench_serving.our_stats(stats, 2.0)["compiled_kernels"] is None
    assert row["tier_capacity_tokens"] is None   # replicas that report no tiers
    for i, w in enumerate(stats["workers"].values()):   # the split kv_memory_mb made, summed over the replicas
        w["tiers"] = {"hot": {"capacity_tokens": 7168}, "warm": {"capacity_tokens": 1024 * (i + 1)},
                      "cold": {"capacity_tokens": 0}}
    assert bench_serving.our_stats(stats, 2.0)["tier_capacity_tokens"] == {"hot": 14336, "warm": 3072, "cold": 0}
    t0 = next(iter(stats["workers"].values()))["tiers"]
    del t0["cold"]
    assert bench_serving.our_stats(stats, 2.0)["tier_capacity_tokens"]["cold"] == 0


def test_our_arm_runs_without_l3_unless_asked_and_says_which(monkeypatch) -> None:
    import httpx

    import serve_app.local as local

    made = []

    class Cluster:
        def __init__(self, **kwargs):
            self.kwargs, self.l3 = kwargs, ("master" if kwargs["l3_pool_mb"] else None)
            made.append(self)

        def deploy(self, config, port):
            self.config = config

        def shutdown(self):
            self.down = True

    class Stats:
        def __init__(self, state):
            self.state = state

        def json(self):
            return {"workers": {"w0": {"l3": {"state": self.state}, "worker": {"decode_kernel": True}}}}

    monkeypatch.setattr(local, "LocalCluster", Cluster)
    for flags, state, l3 in (([], "off", False), (["--l3"], "connected", True), (["--l3"], "off", False)):
        monkeypatch.setattr(httpx, "get", lambda *a, state=state, **k: Stats(state))
        args = bench_serving.resolve_defaults(parser().parse_args(["--port", "9", *flags]))
        row = bench_serving.run_ours(args, "model", lambda base, model: {"workload": "sessions", "wall_s": 1.0},
                                     args.hot_tokens)
        assert made[-1].kwargs["l3_pool_mb"] == (1024 if flags else 0) and made[-1].down
        worker = made[-1].config["worker"]
        assert (worker["hot_blocks"], worker["warm_blocks"], worker["max_batch_tokens"]) == (256, 4096, 512)
        assert (row["impl"], row["workload"], row["l3"], row["compiled_kernels"]) == ("prefix-cache", "sessions", l3,
                                                                                       True)
        assert (row["hot_tokens"], row["warm_tokens"], row["max_batch_tokens"], row["max_running"]) == \
            (4096, 65536, 512, 64)


def stand_in(impl, tokens_per_s, p50, p99, **extra):
    return {"impl": impl, "workload": "sessions", "failed": 0, "output_tokens_per_s": tokens_per_s,
            "ttft_ms_later_turns_p50": p50, "ttft_ms_later_turns_p99": p99, "later_turns_cached_share": 0.95,
            **extra}


def test_the_summary_compares_our_arm_with_each_vllm_arm() -> None:
    ours = stand_in("prefix-cache", 60.0, 100.0, 900.0, recomputed_held_tokens=0, dropped_with_room_tokens=0,
                    dropped_tokens_by_reason={"warm/last_tier": 40, "dropped_tokens": 40})
    same_hot = stand_in("vllm-same-hot", 40.0, 500.0, 1000.0)
    all_memory = stand_in("vllm-all-memory", 70.0, 90.0, 400.0)
    out = bench_serving.compare_sessions(ours, same_hot, all_memory)
    assert (out["throughput_vs_same_hot"], out["throughput_vs_all_memory"]) == (1.5, 0.857)
    assert (out["ttft_ms_later_turns_p50_vs_same_hot"], out["ttft_ms_later_turns_p99_vs_same_hot"]) == (0.2, 0.9)
    assert (out["ttft_ms_later_turns_p50_vs_all_memory"], out["ttft_ms_later_turns_p99_vs_all_memory"]) == (1.111, 2.25)
    goals = {k: v for k, v in out.items() if k.startswith("goal_")}
    assert goals == {"goal_no_failures": True, "goal_later_cached_share_ge_0_9": True,
                     "goal_later_ttft_p50_le_0_2x_same_hot": True,      # 100 <= 0.2 x 500: at the bound
                     "goal_later_ttft_p50_le_1_2x_all_memory": True,    # 100 <= 108
                     "goal_later_ttft_p99_le_same_hot": True,           # 900 <= 1000
                     "goal_throughput_ge_1_5x_same_hot": True,          # 60 >= 1.5 x 40
                     "goal_throughput_ge_0_9x_all_memory": False,       # 60 < 63
                     "goal_no_dropped_with_room": True, "goal_no_recomputed_held": True}
    worse = {**ours, "failed": 1, "later_turns_cached_share": 0.89, "ttft_ms_later_turns_p50": 101.0,
             "recomputed_held_tokens": 16, "dropped_with_room_tokens": 1,
             "dropped_tokens_by_reason": {"hot/copy_failed": 1, "dropped_tokens": 1}}
    out = bench_serving.compare_sessions(worse, same_hot, None)
    assert (out["goal_no_failures"], out["goal_later_cached_share_ge_0_9"], out["goal_later_ttft_p50_le_0_2x_same_hot"],
            out["goal_no_dropped_with_room"], out["goal_no_recomputed_held"]) == (False, False, False, False, False)
    # The arm a goal needs did not run: no ratio, no verdict.
    assert out["throughput_vs_all_memory"] is None and out["goal_throughput_ge_0_9x_all_memory"] is None
    assert out["goal_later_ttft_p50_le_1_2x_all_memory"] is None


def test_sessions_pairs_rotate_three_arms_and_summarize_each_pair(monkeypatch, capsys) -> None:
    import cluster.engine.checkpoint as checkpoint
    import serve_app.local as local

    ran, seen = [], []
    speeds = {"prefix-cache": iter([60.0, 66.0, 50.0]), "vllm-same-hot": iter([40.0, 40.0]),
              "vllm-all-memory": iter([60.0, 80.0])}

    def ours(args, model, drive, hot_tokens):
        seen.append(drive)
        ran.append("prefix-cache")
        return stand_in("prefix-cache", next(speeds["prefix-cache"]), 100.0, 900.0, recomputed_held_tokens=0,
                        dropped_tokens_by_reason={"dropped_tokens": 0})

    def vllm(args, model_dir, drive, hot_tokens, arm):
        seen.append(drive)
        ran.append(arm)
        return stand_in(arm, next(speeds[arm]), 500.0, 1000.0)

    monkeypatch.setattr(bench_serving, "run_ours", ours)
    monkeypatch.setattr(bench_serving, "run_vllm", vllm)
    monkeypatch.setattr(local, "prepare_model", lambda spec: "model")
    monkeypatch.setattr(checkpoint, "load_tokenizer", lambda spec: Words())
    monkeypatch.setattr(checkpoint, "resolve_checkpoint", lambda spec: "/weights")
    args = parser().parse_args(["--pairs", "2", "--peer", "vllm", "--peer-python", "/venv/bin/python",
                                "--doc-tokens", "50"])
    assert bench_serving.run(args) == 0
    assert ran == ["prefix-cache", "vllm-same-hot", "vllm-all-memory", "vllm-all-memory", "vllm-same-hot",
                   "prefix-cache"]
    assert len(set(map(id, seen))) == 1   # one workload, planned once, for every arm
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summaries = [r for r in rows if r["impl"] == "summary"]
    assert [(r["pair"], r["throughput_vs_same_hot"], r["throughput_vs_all_memory"]) for r in summaries] == \
        [(1, 1.5, 1.0), (2, 1.65, 0.825)]
    last = rows[-1]
    assert (last["impl"], last["workload"], last["pairs"]) == ("summary_of_pairs", "sessions", 2)
    assert (last["throughput_vs_all_memory_median"], last["throughput_vs_all_memory_min"],
            last["throughput_vs_all_memory_max"]) == (0.912, 0.825, 1.0)
    assert (last["goal_throughput_ge_0_9x_all_memory_pairs"], last["goal_throughput_ge_1_5x_same_hot_pairs"],
            last["goal_later_ttft_p50_le_0_2x_same_hot_pairs"]) == (1, 2, 2)
    # Without a peer the vLLM arms are skipped: one row, no summary.
    ran.clear()
    assert bench_serving.run(parser().parse_args(["--doc-tokens", "50"])) == 0
    assert ran == ["prefix-cache"]
    assert [r["impl"] for r in map(json.loads, capsys.readouterr().out.splitlines())] == ["prefix-cache"]


def test_worker_overrides_set_our_arms_worker_config_and_bad_ones_are_named() -> None:
    args = bench_serving.resolve_defaults(parser().parse_args(
        ["--worker", "shared_fills=false", "--worker", "time_slice_s=0.25", "--worker", "eviction_policy=lfu"]))
    worker = bench_serving._worker_config(args, 4096)
    assert (worker["shared_fills"], worker["time_slice_s"], worker["eviction_policy"]) == (False, 0.25, "lfu")
    with pytest.raises(ValueError, match="--worker takes KEY=VALUE, got 'riders'"):
        bench_serving.worker_overrides(["riders"])


def test_turn_records_say_when_each_request_was_sent_and_where_its_time_went() -> None:
    late = Turn(3, 1, True, ttft_s=0.25, e2e_s=1.5, prompt_tokens=1480, completion_tokens=30, cached_tokens=1460,
                started_at=107.5, cached_by_tier={"hot": 98, "cold": 1362}, timing_ms={"replica_queue": 180.0},
                itl_s=[0.04, 0.3, 0.05], timing_steps={"steps_waited": 4, "unreached": 2})
    first = Turn(3, 0, True, ttft_s=1.0, e2e_s=2.0, prompt_tokens=1400, completion_tokens=20, started_at=100.0)
    failed = Turn(5, 0, False, error="HTTP 503: busy", started_at=101.25)
    records = turn_records([late, first, failed])
    assert [(r["session"], r["turn"], r["sent_s"]) for r in records] == [(3, 0, 0.0), (5, 0, 1.25), (3, 1, 7.5)]
    assert records[2] == {"session": 3, "turn": 1, "ok": True, "sent_s": 7.5, "ttft_ms": 250.0, "e2e_ms": 1500.0,
                          "itl_ms_max": 300.0, "prompt_tokens": 1480, "completion_tokens": 30, "cached_tokens": 1460,
                          "cached_tokens_by_tier": {"hot": 98, "cold": 1362}, "after_long_pause": False,
                          "timing_ms": {"replica_queue": 180.0}, "timing_steps": {"steps_waited": 4, "unreached": 2},
                          "error": None, "itl_ms": [40.0, 300.0, 50.0]}
    assert (records[1]["ok"], records[1]["ttft_ms"], records[1]["itl_ms_max"], records[1]["error"]) == \
        (False, None, None, "HTTP 503: busy")
    assert records[0]["itl_ms_max"] is None   # one streamed piece: no gap


def test_turns_out_appends_each_arms_requests_tagged_and_keeps_them_out_of_the_rows(monkeypatch, capsys,
                                                                                   tmp_path) -> None:
    import cluster.engine.checkpoint as checkpoint
    import serve_app.local as local

    def ours(args, model, drive, hot_tokens):
        return {**stand_in("prefix-cache", 60.0, 100.0, 900.0), bench_serving.TURNS: [
            Turn(0, 0, True, ttft_s=0.5, e2e_s=1.0, started_at=10.0), Turn(0, 1, True, ttft_s=0.1, e2e_s=0.4,
                                                                          started_at=12.0)]}

    def vllm(args, model_dir, drive, hot_tokens, arm):
        return {**stand_in(arm, 40.0, 500.0, 1000.0), bench_serving.TURNS: [
            Turn(0, 0, True, ttft_s=0.7, e2e_s=1.2, started_at=50.0)]}

    monkeypatch.setattr(bench_serving, "run_ours", ours)
    monkeypatch.setattr(bench_serving, "run_vllm", vllm)
    monkeypatch.setattr(local, "prepare_model", lambda spec: "model")
    monkeypatch.setattr(checkpoint, "load_tokenizer", lambda spec: Words())
    monkeypatch.setattr(checkpoint, "resolve_checkpoint", lambda spec: "/weights")
    out = tmp_path / "turns.jsonl"
    args = parser().parse_args(["--pairs", "2", "--peer", "vllm", "--peer-python", "/venv/bin/python",
                                "--arms", "prefix-cache,vllm-same-hot", "--doc-tokens", "50", "--turns-out", str(out)])
    assert bench_serving.run(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["impl"], r["pair"], r["turn"], r["sent_s"], r["ttft_ms"]) for r in records] == [
        ("prefix-cache", 1, 0, 0.0, 500.0), ("prefix-cache", 1, 1, 2.0, 100.0), ("vllm-same-hot", 1, 0, 0.0, 700.0),
        ("vllm-same-hot", 2, 0, 0.0, 700.0), ("prefix-cache", 2, 0, 0.0, 500.0), ("prefix-cache", 2, 1, 2.0, 100.0)]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and not any(bench_serving.TURNS in r for r in rows)
