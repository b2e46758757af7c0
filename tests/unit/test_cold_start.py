"""Cold start: the packed weights kept on disk (hit, miss, a changed key, the same logits)
and a worker that serves before it has measured its rates (issue 52)."""

import pytest
import torch

from cluster.engine import packed_weights
from cluster.names import WARM
from cluster.engine.model import DecoderModel, ModelConfig
from tests.unit.helpers import WORKER_MODEL, make_worker, run_worker
from tests.unit.reference_forward import forward_one


@pytest.fixture
def packed_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(packed_weights.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(packed_weights.SWITCH_ENV, raising=False)
    return tmp_path


def _model(weights_id="ckpt-1"):
    model = DecoderModel(ModelConfig(**WORKER_MODEL))
    model.weights_id, model.weights_name = weights_id, "tiny/model"
    return model


def _logits(model):
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4])
    return forward_one(model, tokens, 0, None)[0]


def test_packed_weights_miss_then_hit_give_the_same_logits(packed_dir):
    measured = _model()
    measured.tune_linears()
    assert measured.packed_source["source"] == "measured"
    files = sorted(p.name for p in packed_dir.iterdir())
    assert len(files) == 1 and files[0].startswith("tiny_model-") and files[0].endswith(".pt")
    loaded = _model()
    loaded.tune_linears()
    assert loaded.packed_source == {"source": "disk", "path": str(packed_dir / files[0])}
    assert loaded.kernels.layer_layouts == measured.kernels.layer_layouts and loaded.kernels.head_layouts == measured.kernels.head_layouts
    assert sorted(k[0] for k in loaded.kernels.packed) == sorted(k[0] for k in measured.kernels.packed)
    assert torch.equal(_logits(loaded), _logits(measured))   # bit for bit


def test_packed_weights_match_the_unpacked_path(packed_dir, monkeypatch):
    _model().tune_linears()   # writes the file
    cached = _model()
    cached.tune_linears()
    assert cached.packed_source["source"] == "disk"
    monkeypatch.setenv(packed_weights.SWITCH_ENV, "0")
    fresh = _model()
    fresh.tune_linears()
    assert fresh.packed_source == {"source": "memory"}
    assert torch.equal(_logits(cached), _logits(fresh))


def test_a_changed_key_packs_again_and_replaces_the_old_file(packed_dir, monkeypatch):
    _model("ckpt-1").tune_linears()
    (old,) = packed_dir.iterdir()
    changed = _model("ckpt-2")   # another checkpoint under the same name
    changed.tune_linears()
    assert changed.packed_source["source"] == "measured"
    (new,) = packed_dir.iterdir()
    assert new != old
    monkeypatch.setattr(packed_weights, "LAYOUT_VERSION", packed_weights.LAYOUT_VERSION + 1)
    again = _model("ckpt-2")
    again.tune_linears()
    assert again.packed_source["source"] == "measured"


def test_a_file_of_another_key_is_a_miss(packed_dir):
    store = packed_weights.PackedStore("m", "key-a", packed_dir)
    store.save({"layouts": [], "orders": [], "copies": []})
    assert store.load()["key"] == "key-a"
    other = packed_weights.PackedStore("m", "key-b", packed_dir)
    other.path = store.path   # the same file name, another key: refused
    assert other.load() is None


def test_a_model_without_a_checkpoint_is_not_kept(packed_dir):
    model = DecoderModel(ModelConfig(**WORKER_MODEL))
    model.tune_linears()
    assert model.packed_source == {"source": "memory"} and list(packed_dir.iterdir()) == []


def test_checkpoint_identity_changes_with_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 8)
    before = packed_weights.checkpoint_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"a" * 9)
    assert packed_weights.checkpoint_identity(tmp_path) != before


def test_a_worker_serves_on_prior_rates_then_its_own_appear():
    core = make_worker("w-prior", calibrate_at_start=False)
    try:
        assert core.rates_source == "prior" and core.startup["rates_source"] == "prior"
        assert core.refiner.measured == set() and "prefill_tokens_per_s" not in core.refiner.measured
        items = run_worker(core, list(range(40, 140)), max_tokens=2)   # a prefill step of 100 tokens
        assert items[-1].finish_reason is not None   # answered before any rate of its own
        measured = core.loop.call(lambda: (core.refiner.tick(), core.engine.prefill_tokens_per_s)).result()[1]
        assert "prefill_tokens_per_s" in core.refiner.measured
        # In force: the engine's own measurement, or the prior where it is within 25% of it.
        rate = core.cost.prefill_tokens_per_s
        assert rate == measured or abs(measured / rate - 1) <= 0.25
        assert core.rates().prefill_tokens_per_s == rate
    finally:
        core.close()




def test_the_prior_times_a_warm_prefill_not_the_models_first_forward(monkeypatch):
    """The first forward warms the model up (2.5 s for 64 tokens beside Ray's start-up on a
    2-core VM, a tenth of the rate): the prior is the second prefill's rate."""
    from actors import calibration

    core = make_worker("w-prior-warm", calibrate_at_start=False)
    try:
        # The start measured the WARM copy rate (inline promotions read it from the first request).
        assert core.rates_source == "prior" and core.cache.promote_s_per_token[WARM] > 0
        seconds = iter([2.5, 0.25])
        timed = []

        def fake_timed(fn, tokens):
            fn()
            timed.append(tokens)
            return tokens, next(seconds)
        monkeypatch.setattr(calibration, "_timed", fake_timed)
        cost = core.loop.call(lambda: calibration.prior_rates(core.engine)).result()
        assert len(timed) == 2 and cost.prefill_tokens_per_s == pytest.approx(timed[1] / 0.25)
        assert core.loop.call(lambda: core.cache.tree.total_tokens).result() == 0   # it leaves the cache empty
    finally:
        core.close()


def test_kept_rates_round_trip_and_a_foreign_or_bad_file_is_a_miss(tmp_path):
    from cluster.engine.machine_rates import RatesFile

    store = RatesFile("tiny/model", "key-a", tmp_path)
    assert store.load() is None
    store.save({"prefill_tokens_per_s": 300.0, "warm_promote_tokens_per_s": 9e5, "nonsense": 1.0})
    assert store.load() == {"prefill_tokens_per_s": 300.0, "warm_promote_tokens_per_s": 9e5}
    other = RatesFile("tiny/model", "key-b", tmp_path)
    other.path = store.path   # the same file, another key (machine, threads, KV shape): refused
    assert other.load() is None
    store.path.write_text('{"key": "key-a", "rates": {"prefill_tokens_per_s": -1}}')
    assert store.load() is None
    store.path.write_text("{torn")
    assert store.load() is None


def test_a_worker_keeps_what_it_measured_and_the_machines_next_start_takes_it(tmp_path, monkeypatch):
    """Issue 52: a replica with no peer starts on the rates this machine's last replica measured
    (no prior to measure before serving), with the WARM copy rate as the prior would leave it."""
    from cluster.engine import machine_rates

    store = machine_rates.RatesFile("tiny/model", "key", tmp_path)
    monkeypatch.setattr(machine_rates, "rates_file", lambda *args: store)
    first = make_worker("w-kept-1", calibrate_at_start=False)
    try:
        assert first.rates_source == "prior"
        run_worker(first, list(range(1, 140)), max_tokens=2)   # one prompt step the engine measures
        measured = first.loop.call(lambda: first.engine.prefill_tokens_per_s).result()
        assert measured
    finally:
        first.close()
    kept = store.load()   # what it measured itself, only: prefill and the prior's WARM promotion
    assert set(kept) == {"prefill_tokens_per_s", "warm_promote_tokens_per_s"}
    assert kept["prefill_tokens_per_s"] == pytest.approx(measured)
    second = make_worker("w-kept-2", calibrate_at_start=False)
    try:
        assert second.rates_source == "disk" and second.startup["rates_source"] == "disk"
        warm = kept["warm_promote_tokens_per_s"]
        assert (second.cost.prefill_tokens_per_s, second.cost.warm_promote_tokens_per_s) == (kept["prefill_tokens_per_s"], warm)
        assert (second.cost.cold_promote_tokens_per_s, second.cost.transfer_tokens_per_s) == (warm / 10, warm / 4)
        assert second.cache.promote_s_per_token[WARM] == pytest.approx(1 / warm)
    finally:
        second.close()
    calibrated = make_worker("w-kept-3", calibrate_at_start=True)   # asked to calibrate: it does
    try:
        assert calibrated.rates_source == "calibrated"
    finally:
        calibrated.close()


def test_rate_refiner_replaces_only_material_changes():
    from actors.calibration import RateRefiner
    from cluster.routing.policies import CostModel

    readings = {"prefill_tokens_per_s": None, "warm_promote_tokens_per_s": None}
    seen = []
    refiner = RateRefiner(CostModel(prefill_tokens_per_s=1000.0, warm_promote_tokens_per_s=20000.0),
                          {name: (lambda n=name: readings[n]) for name in readings}, seen.append)
    assert refiner.tick() is False and refiner.measured == set() and seen == []
    readings["prefill_tokens_per_s"] = 1200.0   # 20%: not material
    assert refiner.tick() is False and refiner.measured == {"prefill_tokens_per_s"}
    assert refiner.cost.prefill_tokens_per_s == 1000.0
    readings["prefill_tokens_per_s"] = 1500.0
    readings["warm_promote_tokens_per_s"] = 10000.0
    assert refiner.tick() is True
    assert (refiner.cost.prefill_tokens_per_s, refiner.cost.warm_promote_tokens_per_s) == (1500.0, 10000.0)
    assert seen == [refiner.cost] and refiner.changes == 1
    assert refiner.tick() is False and len(seen) == 1   # unchanged readings register nothing
