"""Prompts beside running decodes (``cluster.engine.stall_free``): a step with decodes in
it computes only what the measured prefill rate does in a few measured step times."""

from cluster.engine.engine import EngineRequest, SamplingParams
from cluster.engine.stall_free import MIN_PREFILL_TOKENS, STALL_STEPS, prefill_cap
from tests.unit.test_scheduler import make_engine


def test_the_cap_is_what_the_measured_prefill_rate_computes_in_the_stall_budget():
    # 30 ms steps, 2.5 ms a prompt token: (8 - 1) x 30 / 2.5 = 84 -> 80 (whole blocks of 16)
    assert STALL_STEPS == 8 and prefill_cap(512, 0.030, 0.0025, 16) == 80
    assert prefill_cap(512, 0.030, 0.0001, 16) == 512                   # a fast prefill: the budget
    assert prefill_cap(512, 0.001, 0.01, 16) == MIN_PREFILL_TOKENS      # a prompt still advances
    assert prefill_cap(512, None, 0.0025, 16) == prefill_cap(512, 0.03, None, 16) == 512   # unmeasured


def test_a_prompt_beside_decodes_gets_the_cap_and_alone_the_whole_budget():
    engine = make_engine(hot_blocks=256, budget=64)
    s = engine.scheduler
    decode = engine.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=40)))
    engine.step()
    assert decode.output and decode in s.running                       # it decodes from now on
    for t in range(10):                                                # measured: 10 ms steps,
        s.slicer.steps.forward(t * 0.010)                              # 1 ms a prompt token
    s.measures.prefill_s_per_token = 0.001
    prompt = engine.submit(EngineRequest(list(range(10, 60)), SamplingParams(max_tokens=1)))
    plan = s.schedule()                                                # (8 - 1) x 10 / 1 = 70 -> 68 (blocks of 4)
    sizes = {id(i.request): i.num_tokens for i in plan.items}
    assert sizes == {id(decode): 1, id(prompt): 50}                    # 50 <= 68: the whole prompt
    s.fail_plan(plan, "test")                                          # (not run: planning only)
    engine2 = make_engine(hot_blocks=256, budget=64, stall_free_steps=STALL_STEPS)
    s2 = engine2.scheduler
    for t in range(10):
        s2.slicer.steps.forward(t * 0.010)
    s2.measures.prefill_s_per_token = 0.005                                     # 7 x 10 / 5 = 14 -> 12 -> 32 (floor)
    decode2 = engine2.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=40)))
    engine2.step()
    long = engine2.submit(EngineRequest([t % 60 + 1 for t in range(10, 70)], SamplingParams(max_tokens=1)))
    plan = s2.schedule()
    assert {id(i.request): i.num_tokens for i in plan.items} == {id(decode2): 1, id(long): MIN_PREFILL_TOKENS}
    alone = make_engine(hot_blocks=256, budget=64, stall_free_steps=STALL_STEPS)
    alone.scheduler.measures.prefill_s_per_token = 0.005
    for t in range(10):
        alone.scheduler.slicer.steps.forward(t * 0.010)
    first = alone.submit(EngineRequest([t % 60 + 1 for t in range(10, 110)], SamplingParams(max_tokens=1)))
    plan = alone.scheduler.schedule()
    assert [(id(i.request), i.num_tokens) for i in plan.items] == [(id(first), 64)]   # no decode: the budget


def test_without_the_cap_a_prompt_beside_decodes_gets_the_whole_budget():
    """``stall_free_steps=None`` (the cap off; the default is ``STALL_STEPS`` in the engine and the
    worker): the step's prompt part is the budget left after the decodes, measured rates or not
    (vLLM's chunked prefill); the setting is checked where it is given."""
    from actors.config import WorkerConfig
    import pytest

    from cluster.engine.scheduler_config import SchedulerConfig
    from cluster.errors import InvalidInputError

    assert prefill_cap(512, 0.030, 0.0025, 16, None) == 512
    assert SchedulerConfig().stall_free_steps == WorkerConfig().scheduler_config().stall_free_steps == STALL_STEPS
    engine = make_engine(hot_blocks=256, budget=64, stall_free_steps=None)
    s = engine.scheduler
    for t in range(10):
        s.slicer.steps.forward(t * 0.010)
    s.measures.prefill_s_per_token = 0.005                             # capped, this would be 32
    decode = engine.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=40)))
    engine.step()
    long = engine.submit(EngineRequest([t % 60 + 1 for t in range(10, 110)], SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert {id(i.request): i.num_tokens for i in plan.items} == {id(decode): 1, id(long): 63}
    for bad in (1, 0, True, 2.5, "8"):
        with pytest.raises(InvalidInputError, match="stall_free_steps must be an integer >= 2"):
            SchedulerConfig(stall_free_steps=bad)


def test_the_stall_budget_is_counted_in_steps_of_decodes_alone_not_in_prompt_steps():
    """Under a stream of prompts most steps carry a prompt chunk, so every step's median is a
    prompt step's (here 400 ms); the cap counts steps of decodes alone (10 ms), measured as
    they run, else it would rise with the load it is for (7 x 400 / 5 = 560: the whole budget)."""
    def planned(decode_steps_s):
        engine = make_engine(hot_blocks=256, budget=64, stall_free_steps=STALL_STEPS)
        s = engine.scheduler
        for t in range(10):
            s.slicer.steps.forward(t * 0.400)                          # every step: 400 ms
        s.measures.prefill_s_per_token = 0.005
        decode = engine.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=40)))
        engine.step()                                                  # its prompt (no decode step)
        for step_s in decode_steps_s:
            s.measures.decode_step_s = s.measures._decode_samples.add(step_s)
        long = engine.submit(EngineRequest([t % 60 + 1 for t in range(10, 110)], SamplingParams(max_tokens=1)))
        plan = s.schedule()
        return [i.num_tokens for i in plan.items if i.request is decode], \
            [i.num_tokens for i in plan.items if i.request is long]

    assert planned([]) == ([1], [63])                                  # none measured: every step's median
    assert planned([0.010, 0.012, 0.010]) == ([1], [MIN_PREFILL_TOKENS])   # 7 x 10 / 5 = 14 -> the floor


def test_a_step_of_decodes_alone_is_what_the_measures_keep_as_the_decode_step():
    engine = make_engine(hot_blocks=256, budget=64)
    s = engine.scheduler
    engine.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=5)))
    engine.step()                                                      # the prompt: no decode step yet
    assert s.measures.decode_step_s is None
    engine.step()                                                      # a decode alone
    assert len(s.measures._decode_samples) == s.stats["decode_steps"] == 1
    assert s.measures.decode_step_s == s.measures._decode_samples.recent[0] == s.stats["decode_step_ms"] / 1e3


def test_the_cap_holds_only_while_the_decodes_are_at_least_as_many_as_the_waiting_prompts():
    """The cap holds prompts back to spare the running streams a stall: with more requests
    waiting on prompt compute than decodes in the step, it would hold back more than it spares,
    and the step takes the whole budget (a flood of prompts beside a few streams: held anyway,
    the flood took 20-26% more steps and the queue behind it grew)."""
    assert prefill_cap(512, 0.030, 0.0025, 16, STALL_STEPS, decodes=2, prompts=2) == 80   # as many: capped
    assert prefill_cap(512, 0.030, 0.0025, 16, STALL_STEPS, decodes=2, prompts=3) == 512  # more waiting: all

    def planned(extra_prompts):
        engine = make_engine(hot_blocks=256, budget=64, stall_free_steps=STALL_STEPS)
        s = engine.scheduler
        s.measures.prefill_s_per_token = 0.005
        decode = engine.submit(EngineRequest(list(range(1, 9)), SamplingParams(max_tokens=40)))
        engine.step()
        s.measures.decode_step_s = s.measures._decode_samples.add(0.010)   # capped: 32 tokens
        long = engine.submit(EngineRequest([t % 60 + 1 for t in range(10, 110)], SamplingParams(max_tokens=1)))
        for i in range(extra_prompts):
            engine.submit(EngineRequest([t % 50 + 2 + i for t in range(40)], SamplingParams(max_tokens=1)))
        plan = s.schedule()
        return [i.num_tokens for i in plan.items if i.request is decode], \
            [i.num_tokens for i in plan.items if i.request is long]

    assert planned(0) == ([1], [MIN_PREFILL_TOKENS])   # one prompt beside one stream: capped
    assert planned(1) == ([1], [63])                     # two waiting beside one stream: the whole budget
