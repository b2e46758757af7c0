"""What a copy engine says a copy took: the copy's own time, the rate ``TieredCache.ready``
weighs a promotion by (issue 51: CUDA promotions said 0 s, COLD's included queued compute)."""

import pytest
import torch

from cluster.cache.offload import CudaStreamEngine, ThreadEngine

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def drain(engine, op):
    engine.wait(op)
    done = []
    while not done:
        done = [c for c in engine.poll() if c.op_id == op]
    return done[0]


def test_a_job_that_times_itself_is_taken_at_its_word_else_its_wall_time(monkeypatch):
    import itertools
    import types

    from cluster.cache import offload

    ticks = itertools.count(0.0, 0.5)                                # a clock that moves 0.5 s a reading
    monkeypatch.setattr(offload, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks),
                                                               sleep=offload.time.sleep))
    engine = ThreadEngine("t")
    try:
        timed = drain(engine, engine.submit(lambda: 0.25))          # the upload's device time
        assert timed.error is None and timed.seconds == 0.25
        plain = drain(engine, engine.submit(lambda: None))
        assert plain.error is None and plain.seconds == 0.5            # the wall time between two readings
        failed = drain(engine, engine.submit(lambda: 1 / 0))
        assert isinstance(failed.error, ZeroDivisionError)
    finally:
        engine.close()


@CUDA[0]
@CUDA[1]
def test_a_cuda_copy_reports_its_time_on_the_device(monkeypatch):
    """The copy's time is its two events' elapsed time (ms to s), not 0 and not the wall clock."""
    device = torch.device("cuda")
    engine = CudaStreamEngine(device)
    monkeypatch.setattr(torch.cuda.Event, "elapsed_time", lambda start, end: 250.0)   # what the events say
    src = torch.randn(64 << 20 // 4, pin_memory=True)               # 64 MiB from pinned host memory
    dst = torch.empty(src.shape, device=device)
    done = drain(engine, engine.submit_copies([(dst, src)]))
    assert done.error is None and done.seconds == 0.25
    assert torch.equal(dst.cpu(), src)
    engine.close()
