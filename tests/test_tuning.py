"""Measured routing, on CPU: fake backends whose calls advance a fake clock by a fixed cost, so that
which one is fastest is known exactly and nothing depends on this machine's timing."""

import json

import pytest
import torch

import spectral_ops as so
from spectral_ops import dispatch, environment, tuning
from spectral_ops.backends.torch_backend import TorchBackend
from spectral_ops.linalg import relative_error
from spectral_ops.tuning import Autotuner, Measurement, RoutingCache, routing_key, shape_bucket

PRIMITIVES_TIMED = ("symmetric", "product", "poly_step", "sign_step", "small_chain", "decay_epilogue_")
ENVIRONMENT = {"device": "Fake GPU", "spectral_ops": "test", "torch": "x", "triton": "y", "extension_built_at": "z"}


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.reads = 0  # each timed sample reads it twice

    def __call__(self):
        self.reads += 1
        return self.now


class TimedBackend(TorchBackend):
    """The torch primitives under another name, each call costing ``cost`` seconds of the fake clock.

    It records the tensors it was handed, to show that timing never touches the caller's."""

    needs_self_check = True

    def __init__(self, name, cost, clock, chain=False, fails=()):
        self.name = name
        self.cost = cost
        self.clock = clock
        self.chain = chain
        self.fails = fails
        self.seen = []

    def supports(self, primitive, device, dtype, shape, steps=0):
        return self.chain or primitive != "small_chain"

    def _tick(self, primitive, *operands):
        # The self-check's operands are batched: failing only on a single matrix fails in timing.
        if primitive in self.fails and operands[0].dim() == 2:
            raise RuntimeError(f"{self.name} cannot run {primitive} on one matrix")
        self.clock.now += self.cost
        self.seen.extend(t.data_ptr() for t in operands if isinstance(t, torch.Tensor))

    def symmetric(self, L, R, precision=None):
        self._tick("symmetric", L, R)
        return super().symmetric(L, R, precision)

    def product(self, M, Z, precision=None, **epilogue):
        self._tick("product", M, Z, epilogue.get("Y"))
        return super().product(M, Z, precision, **epilogue)

    def poly_step(self, A, b, c, precision=None):
        self._tick("poly_step", A)
        return super().poly_step(A, b, c, precision)

    def sign_step(self, Z, coefficient, precision=None):
        self._tick("sign_step", Z)
        return super().sign_step(Z, coefficient, precision)

    def decay_epilogue_(self, W, D, keep, step, noise=None):
        self._tick("decay_epilogue_", W, D)
        return super().decay_epilogue_(W, D, keep, step, noise=noise)


class TimedReference(TimedBackend):
    needs_self_check = False


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def tuner(monkeypatch, tmp_path, clock):
    """An autotuner that measures CPU tensors with the fake clock, caching under tmp_path."""
    monkeypatch.delenv(environment.AUTOTUNE, raising=False)
    made = Autotuner(directory=tmp_path, clock=clock, synchronize=lambda device: None,
                     environment=lambda device: ENVIRONMENT, device_types=("cpu",))
    monkeypatch.setattr(dispatch, "_autotuner", made)
    return made


def install(clock, costs, **options):
    backends = {name: (TimedReference if name == "torch" else TimedBackend)(name, cost, clock, **options.get(name, {}))
                for name, cost in costs.items()}
    for backend in backends.values():
        dispatch.register_backend(backend)
    return backends


def weight(shape=(24, 40)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def decayed_as_expected(W, expected):
    # A decay step of 0.1 * 0.1 moves W by about 1%; fp32 Polar Express gets the direction to ~1e-5
    # (README accuracy table), so W itself to ~1e-7; 1e-6 leaves room and catches a wrong backend.
    return relative_error(W, expected) < 1e-6


def test_shape_buckets_round_each_dimension_and_the_batch_up_to_a_power_of_two():
    assert shape_bucket((4096, 4096)) == (1, 4096, 4096)
    assert shape_bucket((4000, 3000)) == (1, 4096, 4096)
    assert shape_bucket((12, 128, 768)) == (16, 128, 1024)
    assert shape_bucket((2, 3, 5, 9)) == (8, 8, 16)
    assert routing_key("product", torch.bfloat16, "bf16", (4096, 4096)) == "product|bfloat16|bf16|1x4096x4096"
    assert routing_key("small_chain", torch.float32, None, (3, 8, 8), steps=5) == \
        "small_chain|float32|exact|4x8x8|steps=5"


@pytest.mark.parametrize("fastest", ["triton", "torch", "cuda"])
def test_the_fastest_eligible_backend_runs_every_primitive_torch_included(tuner, clock, tmp_path, fastest):
    costs = {"cuda": 3.0, "triton": 2.0, "torch": 4.0}
    costs[fastest] = 1.0
    install(clock, costs)
    W = weight()
    expected = so.reference.spectral_decay_svd(W, 2, 0.1, 0.1)
    so.spectral_decay_(W, 2, 0.1, 0.1)
    assert so.last_backend("decay_") == fastest
    assert decayed_as_expected(W, expected)
    [saved] = tuning.cached_files(tmp_path)
    assert saved["environment"] == ENVIRONMENT
    assert saved["choices"], "nothing was measured"
    for key, entry in saved["choices"].items():
        assert entry["choice"] == fastest, key
        # The fake clock makes each call cost exactly its backend's cost.
        assert entry["ms"] == pytest.approx({name: 1e3 * cost for name, cost in costs.items()}), key


def test_a_choice_is_measured_once_then_reused_in_memory_and_by_a_new_process(tuner, clock, tmp_path, monkeypatch):
    backends = install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    so.spectral_power(weight(), 2, method="gram")
    assert clock.reads > 0
    reads = clock.reads
    so.spectral_power(weight(), 2, method="gram")
    assert clock.reads == reads, "timed again"
    # A later process: a new autotuner (nothing in memory) over the same directory times nothing.
    dispatch.reset()
    backends = install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    monkeypatch.setattr(dispatch, "_autotuner", Autotuner(
        directory=tmp_path, clock=clock, synchronize=lambda device: None,
        environment=lambda device: ENVIRONMENT, device_types=("cpu",)))
    so.spectral_power(weight(), 2, method="gram")
    assert so.last_backend("spectral_power") == "triton"
    assert clock.reads == reads, "the cached choices were timed again"
    # ... and only the backend it uses was self-checked (the others were never called).
    assert not backends["cuda"].seen and not backends["torch"].seen


def test_another_gpu_or_build_is_measured_afresh(tuner, clock, tmp_path, monkeypatch):
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    so.spectral_power(weight(), 2, method="gram")
    dispatch.reset()
    install(clock, {"cuda": 1.0, "triton": 2.0, "torch": 3.0})
    monkeypatch.setattr(tuner, "environment", lambda device: {**ENVIRONMENT, "device": "Other GPU"})
    so.spectral_power(weight(), 2, method="gram")
    assert so.last_backend("spectral_power") == "cuda"
    assert len(tuning.cached_files(tmp_path)) == 2


def test_autotune_off_uses_the_fixed_order(tuner, clock, tmp_path, monkeypatch):
    monkeypatch.setenv(environment.AUTOTUNE, "0")
    install(clock, {"cuda": 1.0, "triton": 3.0, "torch": 2.0})
    so.spectral_power(weight(), 2, method="gram")
    # The fixed order leaves products this small to Triton, however slow it is.
    assert so.last_backend("spectral_power") == "triton"
    assert tuning.cached_files(tmp_path) == []


def test_a_forced_backend_is_not_second_guessed(tuner, clock, tmp_path):
    install(clock, {"cuda": 1.0, "triton": 3.0, "torch": 2.0})
    with so.use_backend("torch"):
        so.spectral_power(weight(), 2, method="gram")
    assert so.last_backend("spectral_power") == "torch"
    assert tuning.cached_files(tmp_path) == []


def test_the_self_check_gates_a_backend_before_it_is_timed(tuner, clock):
    backends = install(clock, {"cuda": 3.0, "triton": 1.0, "torch": 2.0})

    class Wrong(TimedBackend):
        def product(self, M, Z, precision=None, **epilogue):
            return super().product(M, Z, precision, **epilogue) * 1.5

    wrong = Wrong("triton", 0.5, clock)
    dispatch.register_backend(wrong)
    with pytest.warns(RuntimeWarning, match="triton backend's product disagrees"):
        result = so.spectral_power(weight(), 2, method="gram")
    assert "triton" not in {e["choice"] for f in tuning.cached_files(tuner.directory)
                            for k, e in f["choices"].items() if k.startswith("product")}
    assert relative_error(result, so.reference.spectral_power_svd(weight(), 2)) < 1e-4
    assert backends["torch"].seen


def test_timing_runs_on_scratch_copies_and_writes_the_weight_once(tuner, clock):
    backends = install(clock, {"cuda": 3.0, "triton": 1.0, "torch": 2.0})
    W = weight()
    expected = W.clone()
    so.spectral_decay_(expected, 2, 0.1, 0.1)  # the torch path, untimed (before tuning)
    dispatch.reset()
    backends = install(clock, {"cuda": 3.0, "triton": 1.0, "torch": 2.0})
    tuner.forget()
    so.spectral_decay_(W, 2, 0.1, 0.1)
    assert torch.allclose(W, expected, atol=1e-6)
    assert W.data_ptr() not in backends["cuda"].seen + backends["torch"].seen


def test_a_backend_that_fails_at_a_shape_is_timed_as_infinite_and_never_chosen(tuner, clock, tmp_path, caplog):
    install(clock, {"cuda": 3.0, "triton": 1.0, "torch": 2.0}, triton={"fails": ("decay_epilogue_",)})
    W = weight()
    expected = so.reference.spectral_decay_svd(W, 2, 0.1, 0.1)
    so.spectral_decay_(W, 2, 0.1, 0.1)
    assert decayed_as_expected(W, expected)
    assert "triton backend failed while being timed" in caplog.text
    [saved] = tuning.cached_files(tmp_path)
    [entry] = [e for k, e in saved["choices"].items() if k.startswith("decay_epilogue_")]
    assert entry["choice"] == "torch" and entry["ms"]["triton"] == float("inf")


def test_the_cache_file_merges_concurrent_writers_and_survives_garbage(tmp_path, caplog):
    first, second = RoutingCache(ENVIRONMENT, tmp_path), RoutingCache(ENVIRONMENT, tmp_path)
    first.put("a", Measurement("triton", {"triton": 1.0, "torch": 2.0}))
    second.put("b", Measurement("torch", {"triton": 3.0, "torch": 2.0}))
    assert set(RoutingCache(ENVIRONMENT, tmp_path).entries()) == {"a", "b"}
    assert not list(tmp_path.glob(".routing-*")), "a temporary file was left behind"
    first.path.write_text("{not json")
    assert RoutingCache(ENVIRONMENT, tmp_path).entries() == {}
    assert "unreadable routing cache" in caplog.text
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = RoutingCache(ENVIRONMENT, blocked / "sub")
    unwritable.put("a", Measurement("torch", {"torch": 1.0}))
    assert unwritable.get("a").choice == "torch"


def test_a_remembered_ranking_skips_a_backend_disabled_in_this_process(tuner, clock):
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    W = weight()
    so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "triton"
    dispatch.reset()
    tuner.forget()

    class Wrong(TimedBackend):
        def poly_step(self, A, b, c, precision=None):
            return super().poly_step(A, b, c, precision) * 1.5

    install(clock, {"cuda": 2.0, "torch": 3.0})
    dispatch.register_backend(Wrong("triton", 1.0, clock))
    with pytest.warns(RuntimeWarning, match="poly_step disagrees"):
        result = so.spectral_power(W, 2, method="gram")
    assert so.last_backend("spectral_power") == "cuda+triton"  # triton keeps the primitives it passed
    assert relative_error(result, so.reference.spectral_power_svd(W, 2)) < 1e-4
    ranked = [tuner.ranking(torch.device("cpu"), key) for key in tuner.cache_for(torch.device("cpu")).entries()]
    assert all(r[0] == "triton" for r in ranked)


def test_no_timing_while_compiling_or_capturing(monkeypatch):
    assert Autotuner.can_time(torch.device("cpu"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not Autotuner.can_time(torch.device("cpu"))


def test_the_cache_lives_under_the_package_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(environment.CACHE_DIR, str(tmp_path / "explicit"))
    assert environment.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv(environment.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert environment.cache_dir() == tmp_path / "spectral_ops"
    data = {"format": tuning.CACHE_FORMAT, "environment": ENVIRONMENT, "choices": {}}
    (tmp_path / "spectral_ops").mkdir()
    (tmp_path / "spectral_ops" / "routing-0.json").write_text(json.dumps(data))
    assert tuning.cached_files()[0]["environment"] == ENVIRONMENT


def test_the_tune_command_fills_the_cache_and_the_report_shows_it(tuner, clock, tmp_path, monkeypatch):
    from spectral_ops.__main__ import main, tune

    monkeypatch.setenv(environment.CACHE_DIR, str(tmp_path))
    install(clock, {"cuda": 2.0, "triton": 1.0, "torch": 3.0})
    text = tune([(16, 24), (3, 8, 40)], ["fp32"], ["decay", "polar"], device="cpu")
    assert "device Fake GPU" in text
    rows = [line for line in text.splitlines() if line.startswith("| product")]
    assert any("| float32 | fp32 | 1x16x32 | triton | triton 1e+03, cuda 2e+03, torch 3e+03 |" in r for r in rows), rows
    assert any("| 4x8x64 |" in r for r in rows), rows
    # Without a GPU the command refuses, with the reason, rather than filling a CPU cache.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--shapes", "64x64"]) == 2
