"""Weight sets paged between disk, host memory and the device, least recently used out first.

A served bundle's weights are a `WeightSet`: its tensors on the host (NumPy, read from the
bundle's weights file) and, while resident, on the device. `Pager.device(weights)` answers the
device copy, uploading it first when it is not resident and evicting the least recently used
sets until the resident ones fit `device_budget`; host copies are bounded by `host_budget` the
same way (a dropped host copy is read again from the file, checked against its sha256).

Eviction only drops the pager's reference: a call that already holds a set's device copy
keeps it until it returns, so a request never loses its weights mid-flight. A set larger than a
budget on its own is refused when it is added (`PagingError`, with the figures).

>>> parse_budget("2GB", total=None), parse_budget("500MiB", total=None)
(2000000000, 524288000)
>>> parse_budget("0.25", total=8_000_000_000)
2000000000
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from nitro.serving import bundle as bundles

__all__ = ["Pager", "PagingError", "WeightSet", "device_memory", "host_memory", "parse_budget"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class PagingError(ValueError):
    """A budget that cannot be read, or a weight set that does not fit its budget alone."""


def parse_budget(text: str, *, total: int | None, option: str = "--device-memory") -> int:
    """Bytes from '2GB', '500MB', '1.5GiB', '123456' or a fraction of `total` ('0.5')."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise PagingError(
            f"{option} must be bytes (2GB, 500MB, 1GiB, 123456) or a fraction of the memory "
            f"(0.5), not {text!r}"
        )
    value = float(match.group(1))
    if not unit and "." in match.group(1):
        if not 0 < value <= 1:
            raise PagingError(f"{option} as a fraction must be over 0 and at most 1, not {text}")
        if total is None:
            raise PagingError(
                f"{option} {text}: this device does not report its memory; give bytes (2GB)"
            )
        return int(value * total)
    if value <= 0:
        raise PagingError(f"{option} must be more than 0 bytes, not {text!r}")
    return int(value * _UNITS[unit])


def device_memory() -> int | None:
    """The first device's memory in bytes, or the machine's memory for a CPU device."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else host_memory()


def host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _quantiles(seconds: deque[float]) -> dict[str, Any]:
    """Count, p50 and p99 in milliseconds of the recorded times."""
    times = sorted(seconds)

    def quantile(q: float) -> float | None:
        return round(times[min(len(times) - 1, int(q * len(times)))] * 1e3, 3) if times else None

    return {"count": len(times), "p50": quantile(0.5), "p99": quantile(0.99)}


def _figure(size: int) -> str:
    return f"{size / 1e6:.1f} MB ({size} bytes)" if size >= 100_000 else f"{size} bytes"


class WeightSet:
    """One bundle's weights: the file they come from, the host copy, the device copy."""

    def __init__(self, name: str, loaded: bundles.Bundle):
        self.name = name
        self.path = f"{loaded.directory}/{bundles.WEIGHTS}"
        # held open: an export that swaps the directory in leaves this file readable
        self.file = open(self.path, "rb")  # noqa: SIM115 - closed with the weight set
        self.sha256: str = loaded.manifest["files"][bundles.WEIGHTS]["sha256"]
        self.nbytes = loaded.weights_bytes
        self.host: dict[str, np.ndarray] | None = loaded.weights
        self.device: dict[str, Any] | None = None
        self.removed = False  # replaced by a reload: a late call uploads it for itself only
        self.uploading = threading.Lock()  # one upload of a set at a time
        self.hits = self.misses = self.evictions = self.disk_reads = 0
        self.swap_seconds: deque[float] = deque(maxlen=1000)

    def read_host(self) -> dict[str, np.ndarray]:
        """The host copy, read again from the weights file when it was dropped."""
        host = self.host
        if host is not None:
            return host
        data = os.pread(self.file.fileno(), os.fstat(self.file.fileno()).st_size, 0)
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise bundles.BundleError(
                f"{self.path} was rewritten in place since {self.name} was loaded; reload the "
                f"model (POST /v2/repository/models/{self.name}/load) to serve the new weights"
            )
        self.disk_reads += 1
        return bundles.weights_from_bytes(data, self.path)

    def stats(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "resident": self.device is not None,
            "in_host_memory": self.host is not None,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "disk_reads": self.disk_reads,
            "swap_in_ms": _quantiles(self.swap_seconds),
        }


class Pager:
    """Device and host copies of weight sets within their budgets (None: no limit)."""

    def __init__(self, device_budget: int | None = None, host_budget: int | None = None):
        self.device_budget, self.host_budget = device_budget, host_budget
        self.resident: OrderedDict[WeightSet, None] = OrderedDict()  # least recent first
        self.in_host: OrderedDict[WeightSet, None] = OrderedDict()
        self.device_used = self.host_used = 0
        self.swap_seconds: deque[float] = deque(maxlen=10_000)  # every set's, for the stats
        self.changed = threading.Condition()

    def add(self, weights: WeightSet) -> None:
        """Start paging `weights` (its host copy counts against the host budget)."""
        for budget, option in ((self.device_budget, "--device-memory"),
                               (self.host_budget, "--host-memory")):  # fmt: skip
            if budget is not None and weights.nbytes > budget:
                raise PagingError(
                    f"{weights.name}'s weights take {_figure(weights.nbytes)}, more than the "
                    f"{option} budget of {_figure(budget)} on their own; raise {option} to at "
                    f"least {weights.nbytes}"
                )
        with self.changed:
            if weights.host is not None:
                self._keep_host(weights, weights.host)

    def remove(self, weights: WeightSet) -> None:
        """Stop paging `weights` (a reload replaced them); calls holding them finish."""
        with self.changed:
            if weights in self.resident:
                del self.resident[weights]
                self.device_used -= weights.nbytes
            if weights in self.in_host:
                del self.in_host[weights]
                self.host_used -= weights.nbytes
            weights.device = weights.host = None
            weights.removed = True
            self.changed.notify_all()

    def device(self, weights: WeightSet) -> Mapping[str, Any]:
        """`weights` on the device, uploaded first (evicting others) when not resident."""
        with self.changed:
            placed = weights.device
            if placed is not None:
                weights.hits += 1
                self.resident.move_to_end(weights)
                return placed
        with weights.uploading:
            with self.changed:
                placed = weights.device
                if placed is not None:  # uploaded while this call waited for it
                    weights.hits += 1
                    self.resident.move_to_end(weights)
                    return placed
                self._make_room(weights)
                self.device_used += weights.nbytes
            try:
                start = time.perf_counter()
                host = weights.read_host()
                placed = jax.block_until_ready(jax.device_put(host))
                seconds = time.perf_counter() - start
            except BaseException:
                with self.changed:
                    self.device_used -= weights.nbytes
                    self.changed.notify_all()
                raise
            with self.changed:
                weights.misses += 1
                weights.swap_seconds.append(seconds)
                self.swap_seconds.append(seconds)
                if weights.removed:
                    self.device_used -= weights.nbytes
                else:
                    weights.device = placed
                    self.resident[weights] = None
                    self._keep_host(weights, host)
                self.changed.notify_all()
            return placed

    def _make_room(self, weights: WeightSet) -> None:
        """Evict least recently used sets until `weights` fits; wait for uploads in progress
        (counted, not yet evictable) when only they stand in the way. Holds `changed`."""
        budget = self.device_budget
        while budget is not None and self.device_used + weights.nbytes > budget:
            if self.resident:
                evicted, _ = self.resident.popitem(last=False)
                evicted.device = None
                evicted.evictions += 1
                self.device_used -= evicted.nbytes
            else:
                self.changed.wait(timeout=1.0)

    def _keep_host(self, weights: WeightSet, host: dict[str, np.ndarray]) -> None:
        """Hold `host` as the set's host copy, dropping least recent copies over the budget."""
        if weights in self.in_host:
            self.in_host.move_to_end(weights)
            return
        weights.host = host
        self.in_host[weights] = None
        self.host_used += weights.nbytes
        while self.host_budget is not None and self.host_used > self.host_budget:
            dropped, _ = self.in_host.popitem(last=False)
            dropped.host = None
            self.host_used -= dropped.nbytes

    def stats(self) -> dict[str, Any]:
        with self.changed:
            return {
                "device_budget": self.device_budget,
                "device_used": self.device_used,
                "resident": [w.name for w in self.resident],
                "host_budget": self.host_budget,
                "host_used": self.host_used,
                "swap_in_ms": _quantiles(self.swap_seconds),
            }
