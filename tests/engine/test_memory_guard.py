import ctypes
import re
import struct
import sys

import psutil
import pytest

from engine.memory import memory_guard as mg
from engine.memory.memory_guard import (
          GiB,
          MemoryGuard,
          MemoryReading,
          MemoryUnavailable,
          VMStatistics64,
          macos_available_bytes,
          read_memory,
          read_meminfo,
          read_psutil,
          read_vm_statistics64,
)

# A recorded /proc/meminfo (24 GiB Linux VM), trimmed.
RECORDED_MEMINFO = """\
MemTotal:       24683656 kB
MemFree:        23356092 kB
MemAvailable:   23552876 kB
Buffers:            6280 kB
Cached:           373604 kB
SwapCached:            0 kB
Active:           154076 kB
Inactive:         872224 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
"""


# ----------------------------------------------------------------------------- Linux


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo exists only on Linux")
def test_real_linux_reading_agrees_with_psutil():
    r = read_meminfo()
    assert r.source == "meminfo"
    assert r.total_bytes > 0 and r.available_bytes > 0
    assert r.available_bytes <= r.total_bytes
    vm = psutil.virtual_memory()
    assert abs(r.total_bytes - vm.total) <= 0.02 * vm.total
    # Other processes allocate between the two reads: loose margin.
    assert abs(r.available_bytes - vm.available) <= max(512 * 1024 ** 2, 0.10 * vm.total)
    assert read_memory().source == "meminfo"


def test_parse_recorded_meminfo(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text(RECORDED_MEMINFO)
    r = read_meminfo(str(p))
    assert r == MemoryReading(total_bytes=24683656 * 1024, available_bytes=23552876 * 1024, source="meminfo")


@pytest.mark.parametrize(
    "text, why",
    [
        (None, "cannot read"),
        ("", "no MemTotal or MemAvailable"),
        ("MemTotal: 1000 kB\nMemFree: 10 kB\n", "no MemAvailable"),  # pre-3.14 kernel
        ("MemTotal: lots kB\nMemAvailable: \x00\x01garbage\n", "no MemTotal or MemAvailable"),
        ("MemTotal: 1000 kB\nMemAvailable: 5000 kB\n", "outside"),
    ],
)
def test_missing_or_garbled_meminfo_refuses_with_reason(tmp_path, text, why):
    p = tmp_path / "meminfo"
    if text is not None:
        p.write_text(text)
    with pytest.raises(MemoryUnavailable, match=why):
        read_meminfo(str(p))

    guard = MemoryGuard(reader=lambda: read_meminfo(str(p)))
    assert guard.reading() is None
    reason = guard.unavailable_reason()
    assert reason and why in reason
    ok, msg = guard.admit(1)
    assert ok is False
    assert reason in msg
    line = guard.startup_line()
    assert line == (f"memory guard: the available RAM cannot be read ({reason}); "
                    "parking and session save/restore are refused")


def test_guard_never_crashes_on_reader_exceptions():
    def boom():
        raise ZeroDivisionError("division by zero")

    g = MemoryGuard(reader=boom)
    assert g.reading() is None
    assert "ZeroDivisionError" in g.unavailable_reason()
    assert g.admit(0)[0] is False
    g2 = MemoryGuard(reader=lambda: "not a reading")
    assert g2.reading() is None and "not MemoryReading" in g2.unavailable_reason()


def test_read_memory_falls_back_to_psutil(monkeypatch):
    def fail():
        raise MemoryUnavailable("primary broke")

    monkeypatch.setattr(mg, "_platform_reader", lambda: fail)
    r = read_memory()
    assert r.source == "psutil"
    assert 0 < r.available_bytes <= r.total_bytes

    def psutil_fail():
        raise MemoryUnavailable("psutil broke")

    monkeypatch.setattr(mg, "read_psutil", psutil_fail)
    with pytest.raises(MemoryUnavailable, match="primary broke; psutil broke"):
        read_memory()


def test_read_psutil():
    r = read_psutil()
    assert r.source == "psutil" and 0 < r.available_bytes <= r.total_bytes


# ----------------------------------------------------------------------------- admission


def _fixed(total, avail, source="meminfo"):
    return lambda: MemoryReading(total_bytes=total, available_bytes=avail, source=source)


def test_default_reserve_is_max_1gib_or_10_percent():
    assert MemoryGuard(reader=_fixed(24 * GiB, 20 * GiB)).reserve_bytes == int(24 * GiB) // 10
    assert MemoryGuard(reader=_fixed(8 * GiB, 6 * GiB)).reserve_bytes == GiB
    assert MemoryGuard(reserve_bytes=123, reader=_fixed(8 * GiB, 6 * GiB)).reserve_bytes == 123


def test_admit_boundary():
    g = MemoryGuard(reserve_bytes=1 * GiB, reader=_fixed(16 * GiB, 5 * GiB))
    ok, why = g.admit(4 * GiB)  # leaves exactly the reserve
    assert ok, why
    ok, why = g.admit(4 * GiB + 1)
    assert not ok
    assert "5.0 GiB is available" in why and "1.0 GiB must stay free" in why


def test_startup_line_format():
    g = MemoryGuard(reader=_fixed(24 * GiB, int(21.3 * GiB)))
    assert g.startup_line() == "memory guard: limit 24.0 GiB (source: meminfo), available 21.3 GiB"
    real = MemoryGuard().startup_line()
    assert re.fullmatch(r"memory guard: limit \d+\.\d GiB \(source: (meminfo|vm_statistics64|psutil)\), "
                        r"available \d+\.\d GiB", real), real


# ----------------------------------------------------------------------------- macOS

# Recorded from a 16 GiB Apple-silicon Mac (16 KiB VM pages, 1,048,576 pages in all)
# under a moderate load: browser, IDE, a 4 GB model mapped.
MAC_PAGE = 16384
MAC_COUNTERS = {
    "free_count": 41_237,           # includes the speculative pages
    "active_count": 318_402,
    "inactive_count": 301_655,
    "wire_count": 172_118,
    "zero_fill_count": 912_334_101,
    "reactivations": 4_118_220,
    "pageins": 9_870_113,
    "pageouts": 51_006,
    "faults": 1_402_556_871,
    "cow_faults": 20_114_345,
    "lookups": 310_221,
    "hits": 77,
    "purges": 2_330_017,
    "purgeable_count": 6_912,
    "speculative_count": 9_518,
    "decompressions": 33_551_200,
    "compressions": 41_210_993,
    "swapins": 118_004,
    "swapouts": 402_775,
    "compressor_page_count": 148_890,
    "throttled_count": 0,
    "external_page_count": 251_306,  # file-backed, incl. the 9,518 speculative
    "internal_page_count": 378_269,  # anonymous: NOT available
    "total_uncompressed_pages_in_compressor": 522_413,
}


def test_macos_available_arithmetic():
    # By hand: (free - speculative) + purgeable + external
    #        = (41,237 - 9,518) + 6,912 + 251,306 = 31,719 + 258,218 = 289,937 pages
    #        = 289,937 * 16,384 = 4,750,327,808 bytes (~4.42 GiB)
    assert macos_available_bytes(MAC_COUNTERS, MAC_PAGE) == 4_750_327_808
    # Inactive anonymous memory does not count: moving pages from internal/inactive changes nothing.
    more_inactive = dict(MAC_COUNTERS, inactive_count=MAC_COUNTERS["inactive_count"] + 100_000,
                         internal_page_count=MAC_COUNTERS["internal_page_count"] + 100_000)
    assert macos_available_bytes(more_inactive, MAC_PAGE) == 4_750_327_808
    # 4 KiB pages (Intel Mac): same page counts, a quarter of the bytes.
    assert macos_available_bytes(MAC_COUNTERS, 4096) == 289_937 * 4096
    with pytest.raises(ValueError):
        macos_available_bytes(MAC_COUNTERS, 0)


def test_vm_statistics64_struct_layout_matches_header():
    # <mach/vm_statistics.h> struct vm_statistics64 (rev4, __attribute__((aligned(8)))):
    #   4 x natural_t | 9 x uint64 (zero_fill..purges) | purgeable, speculative natural_t
    #   | 4 x uint64 (decompressions..swapouts) | 4 x natural_t (compressor_page_count,
    #   throttled, external, internal) | uint64 total_uncompressed_pages_in_compressor
    assert ctypes.sizeof(VMStatistics64) == 152
    assert ctypes.alignment(VMStatistics64) == 8
    assert mg.HOST_VM_INFO64_COUNT == 38  # sizeof / sizeof(integer_t), as in host_info.h
    assert mg.HOST_VM_INFO64 == 4
    fmt = "<4I9Q2I4Q4IQ"
    assert struct.calcsize(fmt) == 152
    order = [name for name, _ in VMStatistics64._fields_]
    assert order == [
        "free_count", "active_count", "inactive_count", "wire_count",
        "zero_fill_count", "reactivations", "pageins", "pageouts", "faults", "cow_faults",
        "lookups", "hits", "purges", "purgeable_count", "speculative_count",
        "decompressions", "compressions", "swapins", "swapouts",
        "compressor_page_count", "throttled_count", "external_page_count", "internal_page_count",
        "total_uncompressed_pages_in_compressor",
    ]
    raw = struct.pack(fmt, *(MAC_COUNTERS[n] for n in order))
    s = VMStatistics64.from_buffer_copy(raw)
    assert {n: getattr(s, n) for n in order} == MAC_COUNTERS
    assert VMStatistics64.external_page_count.offset == 136
    assert VMStatistics64.purgeable_count.offset == 88


@pytest.mark.skipif(sys.platform != "darwin", reason="host_statistics64 and sysctl hw.memsize exist only on macOS")
def test_real_macos_reading():
    r = read_vm_statistics64()
    assert r.source == "vm_statistics64"
    assert 0 < r.available_bytes <= r.total_bytes
    assert r.total_bytes == psutil.virtual_memory().total
    assert read_memory().source == "vm_statistics64"


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_macos_reader_refuses_off_macos():
    with pytest.raises(MemoryUnavailable, match="only on macOS"):
        read_vm_statistics64()
