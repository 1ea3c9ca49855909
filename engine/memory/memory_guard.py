"""How much RAM can we still use?  Read it honestly, per platform, and refuse when unsure.

The guard is consulted before anything that grows resident memory by a large,
known amount (parking a conversation's KV cache, restoring a session file).
It never crashes: if the available RAM cannot be read, it says why and refuses.

Sources
-------
* Linux:  ``/proc/meminfo`` ``MemAvailable`` (the kernel's own estimate of what
  can be allocated without swapping; includes reclaimable page cache/slab), plus the bytes this
  process's malloc holds free for reuse (engine/memory/allocator.py). Source name ``"meminfo"``.
* macOS:  ``host_statistics64(HOST_VM_INFO64)`` through ctypes, total from
  ``sysctl hw.memsize``.  Available = free (without speculative) + purgeable +
  file-backed (external) pages.  Inactive *anonymous* memory is deliberately
  not counted: macOS only gets it back by compressing or swapping.
  Source name ``"vm_statistics64"``.
* Anything else (or when the platform reader fails): ``psutil``.
  Source name ``"psutil"``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass
from typing import Callable

from engine.memory import allocator

GiB = 1024 ** 3


@dataclass(frozen=True)
class MemoryReading:
    total_bytes: int
    available_bytes: int
    source: str


class MemoryUnavailable(RuntimeError):
    """The available RAM could not be read; the message says why."""


# --------------------------------------------------------------------------- Linux


def read_meminfo(path: str = "/proc/meminfo") -> MemoryReading:
    """Parse ``MemTotal`` and ``MemAvailable`` (kB) from a /proc/meminfo-format file."""
    try:
        with open(path, "r", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise MemoryUnavailable(f"cannot read {path}: {e.strerror or e}") from e
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            n = int(parts[0])
        except ValueError:
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        if unit == "kb":
            n *= 1024
        elif unit:
            continue  # unknown unit: don't guess
        values[key.strip()] = n
    missing = [k for k in ("MemTotal", "MemAvailable") if k not in values]
    if missing:
        raise MemoryUnavailable(f"{path} has no {' or '.join(missing)} line")
    total, avail = values["MemTotal"], values["MemAvailable"]
    if total <= 0:
        raise MemoryUnavailable(f"{path} reports MemTotal {total}")
    if avail < 0 or avail > total:
        raise MemoryUnavailable(f"{path} reports MemAvailable {avail} outside 0..MemTotal {total}")
    return MemoryReading(total_bytes=total, available_bytes=avail, source="meminfo")


# --------------------------------------------------------------------------- macOS

natural_t = ctypes.c_uint32


class VMStatistics64(ctypes.Structure):
    """``struct vm_statistics64`` from <mach/vm_statistics.h> (field order matters).

    The header declares it ``__attribute__((aligned(8)))``; the fields below
    happen to need no padding, and ctypes aligns the struct to 8 anyway
    (it contains uint64 members), so sizeof == 152 as in C.
    """

    _fields_ = [
        ("free_count", natural_t),  # includes speculative pages
        ("active_count", natural_t),
        ("inactive_count", natural_t),
        ("wire_count", natural_t),
        ("zero_fill_count", ctypes.c_uint64),
        ("reactivations", ctypes.c_uint64),
        ("pageins", ctypes.c_uint64),
        ("pageouts", ctypes.c_uint64),
        ("faults", ctypes.c_uint64),
        ("cow_faults", ctypes.c_uint64),
        ("lookups", ctypes.c_uint64),
        ("hits", ctypes.c_uint64),
        ("purges", ctypes.c_uint64),
        ("purgeable_count", natural_t),
        ("speculative_count", natural_t),
        # rev1
        ("decompressions", ctypes.c_uint64),
        ("compressions", ctypes.c_uint64),
        ("swapins", ctypes.c_uint64),
        ("swapouts", ctypes.c_uint64),
        ("compressor_page_count", natural_t),
        ("throttled_count", natural_t),
        ("external_page_count", natural_t),  # file-backed (non-swap), incl. speculative
        ("internal_page_count", natural_t),  # anonymous
        ("total_uncompressed_pages_in_compressor", ctypes.c_uint64),
    ]


HOST_VM_INFO64 = 4
# HOST_VM_INFO64_COUNT = sizeof(vm_statistics64_data_t) / sizeof(integer_t)
HOST_VM_INFO64_COUNT = ctypes.sizeof(VMStatistics64) // ctypes.sizeof(ctypes.c_int32)
KERN_SUCCESS = 0


def macos_available_bytes(counters: dict, page_size: int) -> int:
    """Available bytes from vm_statistics64 counters (a dict of field -> pages).

    available = (free - speculative) + speculative-and-other file-backed (external)
                + purgeable

    ``free_count`` as reported by host_statistics64 already includes the
    speculative pages, and the kernel also counts those pages in
    ``external_page_count`` (vm_page_speculate bumps both counters), so the
    speculative pages are taken out of ``free`` once to avoid counting them
    twice.  Purgeable pages are anonymous (never external), so no overlap.
    Inactive anonymous pages are not available: macOS reclaims them only by
    compressing or swapping.
    """
    if page_size <= 0:
        raise ValueError(f"page size {page_size} must be positive")
    free = int(counters["free_count"])
    speculative = int(counters.get("speculative_count", 0))
    purgeable = int(counters["purgeable_count"])
    external = int(counters["external_page_count"])
    pages = max(free - speculative, 0) + purgeable + external
    return pages * page_size


def _sysctl_uint64(libc, name: bytes) -> int:
    value = ctypes.c_uint64(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    rc = libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0))
    if rc != 0:
        err = ctypes.get_errno()
        raise MemoryUnavailable(f"sysctl {name.decode()} failed (errno {err})")
    return int(value.value)


def read_vm_statistics64() -> MemoryReading:
    """macOS only: host_statistics64(HOST_VM_INFO64) + sysctl hw.memsize."""
    if sys.platform != "darwin":
        raise MemoryUnavailable(f"host_statistics64 exists only on macOS (this is {sys.platform})")
    path = ctypes.util.find_library("c") or "/usr/lib/libSystem.B.dylib"
    try:
        libc = ctypes.CDLL(path, use_errno=True)
    except OSError as e:
        raise MemoryUnavailable(f"cannot load {path}: {e}") from e
    libc.mach_host_self.restype = ctypes.c_uint32
    libc.mach_host_self.argtypes = []
    libc.host_statistics64.restype = ctypes.c_int
    libc.host_statistics64.argtypes = [
        ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    libc.host_page_size.restype = ctypes.c_int
    libc.host_page_size.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_size_t)]
    libc.sysctlbyname.restype = ctypes.c_int
    libc.sysctlbyname.argtypes = [
        ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p, ctypes.c_size_t]

    host = libc.mach_host_self()
    page_size = ctypes.c_size_t(0)
    kr = libc.host_page_size(host, ctypes.byref(page_size))
    if kr != KERN_SUCCESS or page_size.value <= 0:
        # The VM page size (16 KiB on Apple silicon) -- not the CPU's 4 KiB for Rosetta.
        page_size = ctypes.c_size_t(_sysctl_uint64(libc, b"vm.pagesize"))
    stats = VMStatistics64()
    count = ctypes.c_uint32(HOST_VM_INFO64_COUNT)
    kr = libc.host_statistics64(host, HOST_VM_INFO64, ctypes.byref(stats), ctypes.byref(count))
    if kr != KERN_SUCCESS:
        raise MemoryUnavailable(f"host_statistics64(HOST_VM_INFO64) returned kern_return_t {kr}")
    if count.value < HOST_VM_INFO64_COUNT:
        # An older kernel filled only rev0: external_page_count is missing.
        raise MemoryUnavailable(
            f"host_statistics64 filled {count.value} of {HOST_VM_INFO64_COUNT} words (no external page count)")
    total = _sysctl_uint64(libc, b"hw.memsize")
    if total <= 0:
        raise MemoryUnavailable(f"sysctl hw.memsize reports {total}")
    counters = {name: getattr(stats, name) for name, _ in VMStatistics64._fields_}
    avail = min(macos_available_bytes(counters, int(page_size.value)), total)
    return MemoryReading(total_bytes=total, available_bytes=avail, source="vm_statistics64")


# --------------------------------------------------------------------------- fallback


def read_psutil() -> MemoryReading:
    try:
        # lazy: psutil may be missing, which is a MemoryUnavailable reading, not an import error
        import psutil
    except ImportError as e:
        raise MemoryUnavailable(f"psutil is not installed ({e})") from e
    try:
        vm = psutil.virtual_memory()
    except Exception as e:  # noqa: BLE001 -- any failure becomes a reason
        raise MemoryUnavailable(f"psutil.virtual_memory() failed: {e!r}") from e
    total, avail = int(vm.total), int(vm.available)
    if total <= 0 or avail < 0:
        raise MemoryUnavailable(f"psutil reports total {total}, available {avail}")
    return MemoryReading(total_bytes=total, available_bytes=min(avail, total), source="psutil")


def read_linux() -> MemoryReading:
    """MemAvailable plus what this process's malloc holds free: with the engine's allocator setting
    (engine/memory/allocator.py) freed K/V memory stays with malloc, and the next allocation reuses it."""
    r = read_meminfo()
    return MemoryReading(r.total_bytes, min(r.total_bytes, r.available_bytes + allocator.held_free_bytes()), r.source)


def _platform_reader() -> Callable[[], MemoryReading] | None:
    if sys.platform.startswith("linux"):
        return read_linux
    if sys.platform == "darwin":
        return read_vm_statistics64
    return None


def read_memory() -> MemoryReading:
    """The platform reader, falling back to psutil; raises MemoryUnavailable with every reason."""
    reasons: list[str] = []
    primary = _platform_reader()
    for reader in ([primary] if primary else []) + [read_psutil]:
        try:
            return reader()
        except MemoryUnavailable as e:
            reasons.append(str(e))
        except Exception as e:  # noqa: BLE001 -- never crash the caller
            reasons.append(f"{getattr(reader, '__name__', reader)} failed: {e!r}")
    raise MemoryUnavailable("; ".join(reasons) or "no memory reader for this platform")


# --------------------------------------------------------------------------- guard


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


_DEFAULT = object()


class MemoryGuard:
    """Admission control for large allocations.

    ``reserve_bytes`` is the head-room that must stay available after an
    admitted allocation; default max(1 GiB, 10% of total RAM).
    """

    def __init__(self, reserve_bytes=_DEFAULT, reader: Callable[[], MemoryReading] = read_memory):
        self._reader = reader
        self._explicit_reserve = None if reserve_bytes is _DEFAULT or reserve_bytes is None else int(reserve_bytes)
        self._last: MemoryReading | None = None
        self._reason: str | None = None
        self.reading()

    # ---- reading -------------------------------------------------------------

    def _read(self) -> MemoryReading | None:
        try:
            r = self._reader()
            if not isinstance(r, MemoryReading):
                raise MemoryUnavailable(f"reader returned {type(r).__name__}, not MemoryReading")
        except MemoryUnavailable as e:
            self._last, self._reason = None, str(e) or "unknown reason"
            return None
        except Exception as e:  # noqa: BLE001 -- never crash
            self._last, self._reason = None, f"{type(e).__name__}: {e}"
            return None
        self._last, self._reason = r, None
        return r

    def reading(self) -> MemoryReading | None:
        """A fresh reading, or None when it cannot be read (see unavailable_reason())."""
        return self._read()

    def unavailable_reason(self) -> str | None:
        """Why the last reading failed, or None if it succeeded."""
        return self._reason

    @property
    def reserve_bytes(self) -> int | None:
        if self._explicit_reserve is not None:
            return self._explicit_reserve
        if self._last is None:
            return None
        return max(GiB, self._last.total_bytes // 10)

    # ---- reporting -----------------------------------------------------------

    def startup_line(self) -> str:
        r = self._read()
        if r is None:
            return (f"memory guard: the available RAM cannot be read ({self._reason}); "
                    "parking and session save/restore are refused")
        return (f"memory guard: limit {_gib(r.total_bytes)} (source: {r.source}), "
                f"available {_gib(r.available_bytes)}")

    def admit(self, nbytes: int) -> tuple[bool, str]:
        """May we allocate ``nbytes`` more?  (ok, reason); the reason is human-readable either way."""
        r = self._read()
        if r is None:
            return False, f"the available RAM cannot be read ({self._reason})"
        nbytes = max(int(nbytes), 0)
        reserve = self.reserve_bytes
        left = r.available_bytes - nbytes
        if left < reserve:
            return False, (f"needs {_gib(nbytes)} but only {_gib(r.available_bytes)} is available "
                           f"and {_gib(reserve)} must stay free (source: {r.source})")
        return True, (f"{_gib(nbytes)} fits: {_gib(r.available_bytes)} available, "
                      f"{_gib(left)} left, reserve {_gib(reserve)}")
