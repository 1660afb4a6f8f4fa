"""Measured routing: which backend is fastest for a primitive at a shape, timed once and remembered.

:mod:`spectral_ops.dispatch` asks an :class:`Autotuner` to choose when more than one backend could
run a primitive call on a GPU. The first call for each (primitive, dtype, precision, shape bucket)
on a GPU model times every eligible backend -- torch/cuBLAS included -- on scratch copies of the
call's operands, interleaved, and keeps the fastest. Choices are cached in memory and in one JSON
file per environment (GPU name and the spectral-ops, torch, triton and extension builds) under
:func:`cache_dir`, so later processes reuse them; ``python -m spectral_ops tune`` fills it ahead of
time and ``python -m spectral_ops`` shows it.

This module measures and remembers; dispatch decides what is eligible (availability, capability,
self-checks) and what to do when tuning does not apply. ``SPECTRAL_OPS_AUTOTUNE=0`` turns it off.
It sits beside dispatch, below the plan, and runs no op: ``spectral_ops.tune``, which runs a training
step's ops ahead of a compiled run so that this module times their primitives, lives above the ops, in
:mod:`spectral_ops.step_tuning`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from . import environment
from ._version import __version__

logger = logging.getLogger("spectral_ops")

# Bumped when the meaning of a cached entry changes, so that old files are not misread.
CACHE_FORMAT = 1


def _ceil_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def shape_bucket(shape: Iterable[int]) -> tuple[int, int, int]:
    """``(batch, rows, cols)``, each rounded up to a power of two: shapes that time alike share a choice."""
    shape = tuple(shape)
    return (_ceil_power_of_two(math.prod(shape[:-2])), _ceil_power_of_two(shape[-2]),
            _ceil_power_of_two(shape[-1]))


def routing_key(primitive: str, dtype: torch.dtype, precision: str | None, shape, steps: int = 0) -> str:
    """The cache key of a primitive call, e.g. ``product|bfloat16|bf16|1x4096x4096``."""
    batch, rows, cols = shape_bucket(shape)
    key = f"{primitive}|{str(dtype).removeprefix('torch.')}|{precision or 'exact'}|{batch}x{rows}x{cols}"
    return f"{key}|steps={steps}" if steps else key


@functools.cache
def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_environment(device: torch.device) -> dict:
    """What a measurement depends on besides the call: the GPU model and the software builds."""
    from ._extension import build_info  # the extension's build time: a rebuilt kernel is a new kernel

    info = build_info() or {}
    return {
        "device": torch.cuda.get_device_name(device),
        "spectral_ops": __version__,
        "torch": torch.__version__,
        "triton": _distribution_version("triton"),
        "extension_built_at": info.get("built_at", "not built"),
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Measurement:
    """The backend chosen for one key, and the median milliseconds per call of each one timed."""

    choice: str
    ms: dict[str, float]


class RoutingCache:
    """The measurements of one environment: in memory, backed by ``<directory>/routing-<id>.json``.

    Writes merge with what other processes wrote meanwhile and replace the file atomically, so a
    crash or a concurrent writer never leaves a torn file. A file that cannot be read is ignored
    (and a directory that cannot be written only loses persistence): routing must never fail a step.
    """

    def __init__(self, environment: dict, directory: Path):
        self.environment = environment
        identity = json.dumps({"format": CACHE_FORMAT, **environment}, sort_keys=True)
        self.path = Path(directory) / f"routing-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
        self._entries = self._read()
        self._write_failed = False

    def _read(self) -> dict[str, Measurement]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning("spectral_ops: ignoring the unreadable routing cache %s (%s)", self.path, error)
            return {}
        if data.get("format") != CACHE_FORMAT or data.get("environment") != self.environment:
            return {}
        return {key: Measurement(entry["choice"], dict(entry["ms"])) for key, entry in data["choices"].items()}

    def get(self, key: str) -> Measurement | None:
        return self._entries.get(key)

    def entries(self) -> dict[str, Measurement]:
        return dict(self._entries)

    def put(self, key: str, measurement: Measurement) -> None:
        self._entries = {**self._read(), **self._entries, key: measurement}
        document = {
            "format": CACHE_FORMAT,
            "environment": self.environment,
            "choices": {k: {"choice": m.choice, "ms": m.ms} for k, m in sorted(self._entries.items())},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=".routing-", suffix=".tmp",
                                             delete=False) as handle:
                json.dump(document, handle, indent=1)
            os.replace(handle.name, self.path)
        except OSError as error:
            if not self._write_failed:
                logger.warning("spectral_ops: cannot write the routing cache %s (%s); choices are kept in "
                               "memory only", self.path, error)
            self._write_failed = True


def cached_files(directory: Path | None = None) -> list[dict]:
    """Every routing cache file under ``directory``: ``{"path", "environment", "choices"}``, for reports."""
    directory = environment.cache_dir() if directory is None else Path(directory)
    found = []
    for path in sorted(directory.glob("routing-*.json")):
        try:
            data = json.loads(path.read_text())
            found.append({"path": path, "environment": data["environment"], "choices": data["choices"]})
        except (OSError, ValueError, KeyError):
            found.append({"path": path, "environment": None, "choices": {}})
    return found


class Autotuner:
    """Times candidate backends and remembers the fastest per key and environment.

    ``clock``, ``synchronize``, ``environment`` and ``device_types`` are parameters so that the
    logic can be tested on CPU with fake backends and a fake clock.
    """

    # Each timed sample lasts about this long (repeating fast calls), so launch jitter averages out.
    SAMPLE_S = 2e-3
    MAX_REPEATS = 100

    def __init__(self, *, directory: Path | None = None, clock: Callable[[], float] = time.perf_counter,
                 synchronize: Callable[[torch.device], None] = _synchronize,
                 environment: Callable[[torch.device], dict] = gpu_environment,
                 device_types: tuple[str, ...] = ("cuda",), rounds: int = 5):
        self.directory = directory
        self.clock = clock
        self.synchronize = synchronize
        self.environment = environment
        self.device_types = device_types
        self.rounds = rounds
        self._caches: dict[tuple, RoutingCache] = {}

    def forget(self) -> None:
        """Drop what is held in memory; the files stay and are read again on next use."""
        self._caches.clear()

    def applies(self, device: torch.device) -> bool:
        """Measured routing is used on these devices unless ``SPECTRAL_OPS_AUTOTUNE=0``."""
        return environment.autotune_enabled() and device.type in self.device_types

    @staticmethod
    def can_time(device: torch.device) -> bool:
        """Not while a CUDA graph is being captured or torch.compile traces: both forbid the
        synchronisations that timing needs (cached choices still apply)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return not torch.compiler.is_compiling()

    def cache_for(self, device: torch.device) -> RoutingCache:
        key = (device.type, device.index)
        if key not in self._caches:
            directory = environment.cache_dir() if self.directory is None else self.directory
            self._caches[key] = RoutingCache(self.environment(device), directory)
        return self._caches[key]

    def ranking(self, device: torch.device, key: str) -> list[str]:
        """The backends measured for ``key``, fastest first, leaving out those that failed ([] if none)."""
        measurement = self.cache_for(device).get(key)
        if measurement is None:
            return []
        return sorted((name for name, ms in measurement.ms.items() if math.isfinite(ms)), key=measurement.ms.get)

    def measure(self, device: torch.device, key: str, runs: dict[str, Callable[[], object]]) -> str:
        """Times ``runs`` (backend name -> a call on scratch operands), remembers, and returns the fastest."""
        ms = self.time_ms(device, runs)
        finite = {name: t for name, t in ms.items() if math.isfinite(t)}
        # Every candidate passed its self-check; if all of them fail at this shape, the first (the
        # fixed order's choice) is returned and will raise for the caller, as without tuning.
        choice = min(finite, key=finite.get) if finite else next(iter(runs))
        self.cache_for(device).put(key, Measurement(choice, ms))
        logger.debug("spectral_ops: %s measured %s -> %s", key, ms, choice)
        return choice

    def time_ms(self, device: torch.device, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median milliseconds per call of each run, sampled in interleaved rounds so that clock and
        thermal drift hit every candidate alike. A run that raises is timed as infinite."""
        repeats, failed = {}, {}
        for name, run in runs.items():
            try:
                run()  # warm-up: JIT compilation, allocator, caches
                first = self._sample(device, run, 1)
            except Exception as error:  # a kernel that fails at this shape must not be chosen
                logger.warning("spectral_ops: the %s backend failed while being timed: %r", name, error)
                failed[name] = math.inf
                continue
            repeats[name] = max(1, min(self.MAX_REPEATS, math.ceil(self.SAMPLE_S / max(first, 1e-9))))
        samples = {name: [] for name in repeats}
        for _ in range(self.rounds):
            for name, count in repeats.items():
                samples[name].append(self._sample(device, runs[name], count))
        return {**{name: 1e3 * statistics.median(s) for name, s in samples.items()}, **failed}

    def _sample(self, device: torch.device, run: Callable[[], object], count: int) -> float:
        self.synchronize(device)
        start = self.clock()
        for _ in range(count):
            run()
        self.synchronize(device)
        return (self.clock() - start) / count
