"""The valid range of the conversation cache settings: one rule, used by the engine, the CLI and server
flags, and the app's settings page (plain Python: no mlx, no Qt).

The cap on parked K/V may be 0 (off) up to half of this machine's RAM: parking more than that would
push the model, the live conversation and everything else into swap before the memory guard (which
looks at *available* RAM at each park) could help. When the RAM cannot be read there is no upper bound
to give; the guard then refuses every park anyway, so any cap >= 0 is harmless.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestError

MIB = 1 << 20
GIB = 1 << 30
SLOTS_MAX = 64
# The defaults, defined here only: EngineOptions, the CLI flags, the app's settings and EngineThread read them.
DEFAULT_CACHE_MIB = 1024
DEFAULT_CACHE_SLOTS = 4
# The disk tier under parking (engine/disk/disk_tier.py): conversations' K/V in the data folder's cache, 0 = off.
# 4 GiB holds about 22 conversations of 8,000 SmolLM2 tokens at 16-bit K/V (23,040 B/token).
DEFAULT_DISK_MIB = 4096
DISK_MIB_MAX = 1 << 20          # 1 TiB: a bound on typing, not a recommendation
# generate requests decoded together in one batch (engine/generation/batching.py); the rest queue.
# The CLI, the server and the app start from this; an engine built in code from 1 (one at a time).
DEFAULT_MAX_SEQUENCES = 8
MAX_SEQUENCES_MAX = 256
# The K/V storage widths (engine/cache/kv_format.py; 16 = unquantized): the CLI flag, Configure and the
# settings page offer exactly these.
KV_BITS = (16, 8, 4)
# Whether a loaded control vector applies to requests that name no setting: EngineOptions, the CLI
# flag, the app's settings, its Default config and EngineThread all start from this one value.
SPEED_PROJECTION_DEFAULT = True


class CacheLimitError(RequestError):
    """A cache setting outside its range (or one the loaded model cannot take); the message is one
    line, `reason` the Configure field it is about ("cache_mib", "kv_bits"...), "" when none is named."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.reason = field


@dataclass(frozen=True)
class CacheRange:
    """0..max_mib MiB; max_mib None when the machine's RAM could not be read."""
    max_mib: int | None
    total_bytes: int | None

    def describe(self) -> str:
        if self.max_mib is None:
            return "at least 0 MiB (this machine's RAM could not be read)"
        return f"0 to {self.max_mib} MiB (half of this machine's {self.total_bytes / GIB:.1f} GiB)"


def cache_range(total_bytes: int | None) -> CacheRange:
    """The range for a machine with `total_bytes` of RAM (None: unknown)."""
    if total_bytes is None or total_bytes <= 0:
        return CacheRange(None, None)
    return CacheRange((int(total_bytes) // 2) // MIB, int(total_bytes))


def machine_cache_range() -> CacheRange:
    """The range on this machine, read now (the memory guard's reader)."""
    # lazy: the memory guard loads numpy, which the app (it imports this module) does not need
    from engine.memory.memory_guard import MemoryUnavailable, read_memory
    try:
        return cache_range(read_memory().total_bytes)
    except MemoryUnavailable:
        return cache_range(None)


def _whole(value: object, lo: int, hi: int | None, field: str, not_whole: str, out_of_range: str) -> int:
    """`value` as an int in lo..hi (hi None: no top), else CacheLimitError for `field` with
    `not_whole` or `out_of_range` (each formatted with the value: {value!r} / {value})."""
    try:
        n = int(value)                                     # type: ignore[arg-type]
        if n != value and not isinstance(value, str):
            raise ValueError
    except (TypeError, ValueError):
        raise CacheLimitError(not_whole.format(value=value), field) from None
    if n < lo or (hi is not None and n > hi):
        raise CacheLimitError(out_of_range.format(value=n), field)
    return n


def check_cache_mib(mib: object, limits: CacheRange | None = None, what: str = "the conversation cache") -> int:
    """`mib` as an int if it is in range, else CacheLimitError naming the range."""
    limits = limits or machine_cache_range()
    r = limits.describe()
    return _whole(mib, 0, limits.max_mib, "cache_mib", f"{what} must be a whole number of MiB, {r}; got {{value!r}}",
                  f"{what} must be {r}; got {{value}} MiB")


def check_cache_slots(slots: object, what: str = "the conversation cache slots") -> int:
    return _whole(slots, 1, SLOTS_MAX, "cache_slots",
                  f"{what} must be a whole number from 1 to {SLOTS_MAX}; got {{value!r}}",
                  f"{what} must be 1 to {SLOTS_MAX}; got {{value}}")


def within_range(mib: object, slots: object, limits: CacheRange) -> tuple[int, int, str | None]:
    """(cap, slots) brought into range, and what was changed (None when both were valid)."""
    notes = []
    try:
        cap = check_cache_mib(mib, limits)
    except CacheLimitError as e:
        cap = mib if isinstance(mib, int) else 0
        cap = max(cap, 0) if limits.max_mib is None else min(max(cap, 0), limits.max_mib)
        notes.append(f"{e}: using {cap} MiB")
    try:
        n = check_cache_slots(slots)
    except CacheLimitError as e:
        n = min(max(slots if isinstance(slots, int) else 1, 1), SLOTS_MAX)
        notes.append(f"{e}: using {n}")
    return cap, n, "; ".join(notes) or None


def check_disk_mib(mib: object, what: str = "the conversation disk cache") -> int:
    """The disk tier's cap: a whole number of MiB, 0 (off) to DISK_MIB_MAX; else CacheLimitError."""
    return _whole(mib, 0, DISK_MIB_MAX, "disk_mib",
                  f"{what} must be a whole number of MiB, 0 (off) to {DISK_MIB_MAX}; got {{value!r}}",
                  f"{what} must be 0 (off) to {DISK_MIB_MAX} MiB; got {{value}} MiB")


def check_kv_bits(bits: object) -> int:
    """The K/V storage width: one of KV_BITS, else CacheLimitError."""
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise CacheLimitError(f"K/V bits must be one of {', '.join(map(str, KV_BITS))} (got {bits!r})", "kv_bits")
    return int(bits)                                       # type: ignore[arg-type]


def check_configure(kv_bits=None, cache_mib=None, cache_slots=None, disk_mib=None) -> dict:
    """The bounds of a Configure request's values (None: unchanged), checked where the request is
    built, for every caller (the app's settings, the server, tests): the values as ints, else
    CacheLimitError naming the field. The cache's cap is this machine's range (the memory guard's reader)."""
    return {
        "kv_bits": None if kv_bits is None else check_kv_bits(kv_bits),
        "cache_mib": None if cache_mib is None else check_cache_mib(cache_mib),
        "cache_slots": None if cache_slots is None else check_cache_slots(cache_slots),
        "disk_mib": None if disk_mib is None else check_disk_mib(disk_mib),
    }
