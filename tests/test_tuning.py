"""Measured routing, on CPU: fake backends whose calls advance a fake clock by a fixed cost, so that
which one is fastest is known exactly and nothing depends on this machine's timing."""

import json

import pytest
import torch
from timed_backends import ENVIRONMENT, PRIMITIVES_TIMED, TimedBackend, install, weight

import spectral_ops as so
from spectral_ops import dispatch, environment, tuning
from spectral_ops.linalg import relative_error
from spectral_ops.tuning import Autotuner, Measurement, RoutingCache, routing_key, shape_bucket


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


def primitive_call(kernels, primitive):
    """One call of ``primitive`` on ``kernels`` with operands as the plan passes them (a wide stack)."""
    X = weight((3, 24, 40)) / 10
    G = X @ X.mT
    calls = {
        "symmetric": lambda: kernels.symmetric(X, X.mT, "fp32"),
        "product": lambda: kernels.product(G, X, "fp32"),
        "poly_step": lambda: kernels.poly_step(G, 1.0, -0.5, "fp32"),
        "sign_step": lambda: kernels.sign_step(G / 10, (1.5, -0.5, 0.0), "fp32"),
        "small_chain": lambda: kernels.small_chain(X, 2, COEFFICIENTS, "fp32"),
        "decay_epilogue_": lambda: kernels.decay_epilogue_(X, G @ X, 0.9, 0.1),
    }
    return calls[primitive]()


COEFFICIENTS = so.coefficients.polar_express_coefficients()
# The ways a call meets the router with nothing measured for it, as on a GPU.
UNMEASURED_PATHS = {
    "compiled cold": lambda tuner, monkeypatch: monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True),
    "capture": lambda tuner, monkeypatch: monkeypatch.setattr(tuner, "can_time", lambda device: False),
    "autotune off": lambda tuner, monkeypatch: monkeypatch.setenv(environment.AUTOTUNE, "0"),
}


@pytest.mark.parametrize("primitive", PRIMITIVES_TIMED)
@pytest.mark.parametrize("path", ["eager cold", *UNMEASURED_PATHS])
def test_a_hand_written_kernel_runs_only_after_a_measurement(tuner, clock, modelled_gpu, monkeypatch, path,
                                                              primitive):
    """Per path, where a GPU would run each primitive (the epilogue and the fused chain included): the
    kernels here are faster in truth, but only a cold eager call, which times them, may choose them;
    every other path finds nothing measured and runs torch (a small chain: the composed one)."""
    backends = install(clock, {"cuda": 1.0, "triton": 2.0, "torch": 3.0}, cuda={"chain": True},
                       triton={"chain": True})
    if path != "eager cold":
        UNMEASURED_PATHS[path](tuner, monkeypatch)
    kernels = dispatch.kernels_for("routing", weight())
    result = primitive_call(kernels, primitive)
    if path == "eager cold":
        assert kernels.used == {"cuda"} and tuning.cached_files(tuner.directory)
        return
    # Nothing was timed, and no kernel ran: not even a self-check of one that could not be chosen.
    assert tuning.cached_files(tuner.directory) == []
    ran = {name for name, backend in backends.items() if backend.seen}
    if primitive == "small_chain":
        assert result is None and ran == set()  # no fused chain: the plan composes it from the others
    else:
        assert ran == {"torch"}


def test_the_composed_chain_is_timed_against_the_fused_ones(tuner, clock, tmp_path):
    """A fused chain costs one call here; the composed chain dozens of the others' calls: with a slow
    chain the composed one wins the measurement, and the plan composes."""
    install(clock, {"cuda": 1e-3, "triton": 1e-3, "torch": 1e-3}, cuda={"chain": True})
    backends = dispatch._backends
    backends["cuda"].cost = 1.0  # the chain's backend is slow at everything, its chain included
    kernels = dispatch.kernels_for("routing", weight())
    assert primitive_call(kernels, "small_chain") is None
    [saved] = tuning.cached_files(tmp_path)
    [chain] = [entry for key, entry in saved["choices"].items() if key.startswith("small_chain")]
    assert chain["choice"] == "composed" and set(chain["ms"]) == {"cuda", "composed"}


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
