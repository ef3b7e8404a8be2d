"""Weight sets paged between disk, host memory and the device, least recently used out first.

A served bundle's weights are a `WeightSet`: its tensors on the host (NumPy, read from the
bundle's weights file) and, while resident, on the device. A call runs inside
`Pager.hold(weights)`, which answers the device copy, uploading it first when it is not
resident and evicting the least recently used sets no call holds until it fits `device_budget`;
host copies are bounded by `host_budget` the same way (a dropped host copy is read again from
the file, checked against its sha256).

How memory is bounded: every device copy counts against `device_budget` from the start of its
upload until it is evicted, or, for a set a reload removed while calls held it, until the last
of them returns; a set is never evicted while a call holds it, and an upload that finds only
held sets in its way waits for a call to return. So the device copies alive never exceed the
budget (`device_peak` in the stats). Host copies the pager keeps never exceed `host_budget`
(`host_peak`); beyond them live only the copies being read: one per upload in progress of a set
whose host copy was dropped, and the weights of a bundle being (re)loaded until it is added.
A set larger than a budget on its own is refused when it is added (`PagingError`, with the
figures).

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import jax

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


def _memory(kind: str) -> Any:
    """A sharding on the first device in its memory of `kind` ("pinned_host", "device"), or
    None where the platform has no such memory."""
    device = jax.devices()[0]
    if kind not in {m.kind for m in device.addressable_memories()}:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def pin(host: Mapping[str, Any]) -> Mapping[str, Any]:
    """A host copy in the device's pinned host memory where it has one (page-locked: the
    upload is one DMA, no staging copy), else the numpy arrays as they are."""
    pinned = _memory("pinned_host")
    return host if pinned is None else jax.device_put(dict(host), pinned)


def upload(host: Mapping[str, Any]) -> Mapping[str, Any]:
    """A host copy (pinned or numpy) on the device, in its own memory."""
    device = _memory("device")
    placed = jax.device_put(dict(host), device) if device is not None else jax.device_put(host)
    return jax.block_until_ready(placed)


def host_memory_kind() -> str:
    """Where host copies live: "pinned_host" where the platform has it, else "numpy"."""
    return "pinned_host" if _memory("pinned_host") is not None else "numpy"


class WeightSet:
    """One bundle's weights: the file they come from, the host copy, the device copy."""

    def __init__(self, name: str, loaded: bundles.Bundle):
        self.name = name
        self.path = f"{loaded.directory}/{bundles.WEIGHTS}"
        # held open: an export that swaps the directory in leaves this file readable
        self.file = open(self.path, "rb")  # noqa: SIM115 - closed with the weight set
        self.sha256: str = loaded.manifest["files"][bundles.WEIGHTS]["sha256"]
        self.nbytes = loaded.weights_bytes
        self.host: Mapping[str, Any] | None = loaded.weights  # pinned once paged (`pin`)
        self.device: Mapping[str, Any] | None = None
        self.removed = False  # replaced by a reload: a late call uploads it for itself only
        self.uploading = threading.Lock()  # one upload of a set at a time
        self.holders = 0  # calls running with the device copy: it is not evicted meanwhile
        self.in_flight = 0  # requests that arrived for this set and are not answered yet
        self.hits = self.misses = self.evictions = self.evicted_in_flight = self.disk_reads = 0
        self.swap_seconds: deque[float] = deque(maxlen=1000)

    def read_host(self) -> Mapping[str, Any]:
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
            "evicted_in_flight": self.evicted_in_flight,
            "disk_reads": self.disk_reads,
            "swap_in_ms": _quantiles(self.swap_seconds),
        }


class Pager:
    """Device and host copies of weight sets within their budgets (None: no limit)."""

    def __init__(self, device_budget: int | None = None, host_budget: int | None = None):
        self.device_budget, self.host_budget = device_budget, host_budget
        self.resident: OrderedDict[WeightSet, None] = OrderedDict()  # least recent first
        self.in_host: OrderedDict[WeightSet, None] = OrderedDict()
        self.device_used = self.host_used = self.device_peak = self.host_peak = 0
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
        """Stop paging `weights` (a reload replaced them); calls holding them finish, and
        their device copy counts until the last returns."""
        with self.changed:
            self.resident.pop(weights, None)
            if weights.holders == 0:
                self._drop_device(weights)
            if weights in self.in_host:
                del self.in_host[weights]
                self.host_used -= weights.nbytes
            weights.host = None
            weights.removed = True
            self.changed.notify_all()

    @contextmanager
    def request(self, weights: WeightSet) -> Iterator[None]:
        """Around a request for `weights`, from its arrival to its answer: an eviction
        counts the requests in flight it makes wait for an upload (`evicted_in_flight`)."""
        with self.changed:
            weights.in_flight += 1
        try:
            yield
        finally:
            with self.changed:
                weights.in_flight -= 1

    @contextmanager
    def hold(self, weights: WeightSet) -> Iterator[Mapping[str, Any]]:
        """`weights` on the device for one call: uploaded first when not resident, evicting
        the least recently used sets no call holds (waiting for a call to return when every
        resident set is held); never evicted while held."""
        placed = self._acquire(weights)
        try:
            yield placed
        finally:
            with self.changed:
                weights.holders -= 1
                if weights.holders == 0 and weights.removed:
                    self._drop_device(weights)
                self.changed.notify_all()

    def _acquire(self, weights: WeightSet) -> Mapping[str, Any]:
        with self.changed:
            if weights.device is not None:
                return self._hit(weights)
        with weights.uploading:
            with self.changed:
                if weights.device is not None:  # uploaded while this call waited for it
                    return self._hit(weights)
                self._make_room(weights.nbytes)
                self.device_used += weights.nbytes
                self.device_peak = max(self.device_peak, self.device_used)
                weights.holders += 1
            try:
                start = time.perf_counter()
                host = weights.read_host()
                placed = upload(host)
                seconds = time.perf_counter() - start
            except BaseException:
                with self.changed:
                    weights.holders -= 1
                    self.device_used -= weights.nbytes
                    self.changed.notify_all()
                raise
            with self.changed:
                weights.misses += 1
                weights.swap_seconds.append(seconds)
                self.swap_seconds.append(seconds)
                weights.device = placed
                if not weights.removed:  # a removed set is uploaded for its late calls only
                    self.resident[weights] = None
                    self._keep_host(weights, host)
            return placed

    def _hit(self, weights: WeightSet) -> Mapping[str, Any]:
        """Holds `changed`."""
        weights.hits += 1
        weights.holders += 1
        if weights in self.resident:
            self.resident.move_to_end(weights)
        assert weights.device is not None
        return weights.device

    def _drop_device(self, weights: WeightSet) -> None:
        """Holds `changed`."""
        if weights.device is not None:
            weights.device = None
            self.device_used -= weights.nbytes

    def _make_room(self, size: int) -> None:
        """Evict least recently used sets no call holds until `size` more bytes fit; wait
        for a call to return when only held sets (or uploads) stand in the way. Holds
        `changed`."""
        budget = self.device_budget
        while budget is not None and self.device_used + size > budget:
            idle = next((w for w in self.resident if w.holders == 0), None)
            if idle is None:
                self.changed.wait()
                continue
            del self.resident[idle]
            self._drop_device(idle)
            idle.evictions += 1
            idle.evicted_in_flight += idle.in_flight

    def _keep_host(self, weights: WeightSet, host: Mapping[str, Any]) -> None:
        """Hold `host` as the set's host copy, dropping least recent copies over the budget."""
        if weights in self.in_host:
            self.in_host.move_to_end(weights)
            return
        weights.host = pin(host)
        self.in_host[weights] = None
        self.host_used += weights.nbytes
        while self.host_budget is not None and self.host_used > self.host_budget:
            dropped, _ = self.in_host.popitem(last=False)
            dropped.host = None
            self.host_used -= dropped.nbytes
        self.host_peak = max(self.host_peak, self.host_used)

    def stats(self) -> dict[str, Any]:
        with self.changed:
            return {
                "host_memory_kind": host_memory_kind(),
                "device_budget": self.device_budget,
                "device_used": self.device_used,
                "device_peak": self.device_peak,
                "resident": [w.name for w in self.resident],
                "host_budget": self.host_budget,
                "host_used": self.host_used,
                "host_peak": self.host_peak,
                "swap_in_ms": _quantiles(self.swap_seconds),
            }
