"""engine.limits: the one range rule for the conversation cache (0..half of RAM), and the engine keeping to
it at start and on Configure (the real engine on the tiny GGUF)."""
from __future__ import annotations

import pytest

from engine.limits import (GIB, CacheLimitError, cache_range, check_cache_mib, check_cache_slots,
                           machine_cache_range, within_range)


def test_range_is_half_of_ram():
    r = cache_range(16 * GIB)
    assert r.max_mib == 8192 and r.describe() == "0 to 8192 MiB (half of this machine's 16.0 GiB)"
    assert cache_range(None).max_mib is None and cache_range(0).max_mib is None
    assert cache_range(3 * GIB + 1).max_mib == 1536


@pytest.mark.parametrize("value, ok", [(0, 0), (8192, 8192), ("512", 512), (-5, None), (8193, None),
                                       (2.5, None), ("lots", None), (None, None)])
def test_check_cache_mib(value, ok):
    r = cache_range(16 * GIB)
    if ok is not None:
        assert check_cache_mib(value, r) == ok
    else:
        with pytest.raises(CacheLimitError) as e:
            check_cache_mib(value, r)
        assert "0 to 8192 MiB" in str(e.value) and "\n" not in str(e.value)


def test_unknown_ram_has_no_upper_bound_but_no_negatives():
    r = cache_range(None)
    assert check_cache_mib(10 ** 7, r) == 10 ** 7
    with pytest.raises(CacheLimitError, match="could not be read"):
        check_cache_mib(-1, r)


def test_slots():
    assert check_cache_slots(1) == 1 and check_cache_slots(64) == 64
    for bad in (0, 65, -3, "x"):
        with pytest.raises(CacheLimitError, match="1 to 64"):
            check_cache_slots(bad)


def test_within_range():
    r = cache_range(16 * GIB)
    assert within_range(1024, 4, r) == (1024, 4, None)
    cap, slots, note = within_range(999_999, 0, r)
    assert (cap, slots) == (8192, 1) and "using 8192 MiB" in note and "using 1" in note
    assert within_range(-5, 4, r)[:2] == (0, 4)


def test_machine_range_matches_the_guard():
    from engine.memory.memory_guard import read_memory
    assert machine_cache_range().max_mib == read_memory().total_bytes // 2 >> 20


def test_engine_keeps_to_the_range(tiny_gguf):
    """A start value out of range is brought into range with a log line; Configure refuses; status gives the max."""
    from engine.engine import Configure, Engine, EngineOptions, Status
    from engine.errors import StrataError
    top = machine_cache_range().max_mib
    engine = Engine(EngineOptions(model=str(tiny_gguf), cache_mib=top + 100, cache_slots=4)).start()
    try:
        status = engine.call(Status(), timeout=60)
        assert status.cache_mib_max == top and status.parking["cap_bytes"] == top << 20
        with pytest.raises(StrataError, match=f"0 to {top} MiB"):
            engine.call(Configure(cache_mib=-5))
        assert engine.call(Configure(cache_mib=top)).parking["cap_bytes"] == top << 20
    finally:
        engine.stop()


@pytest.mark.parametrize("kw, field", [({"cache_slots": 0}, "cache_slots"), ({"cache_mib": -1}, "cache_mib"),
                                       ({"disk_mib": -1}, "disk_mib"), ({"kv_bits": 5}, "kv_bits")])
def test_configure_checks_its_bounds_as_it_is_built(kw, field):
    """The one place the bounds are checked for every caller: a Configure out of range is never built,
    and the refusal names the field (the app shows it next to that setting)."""
    from engine.api import Configure
    with pytest.raises(CacheLimitError) as e:
        Configure(**kw)
    assert e.value.reason == field and "\n" not in str(e.value)
    assert Configure(cache_mib="512", cache_slots=3).cache_mib == 512       # as ints once built


def test_a_refused_configure_changes_nothing(tiny_gguf):
    """Applied whole or not at all: a K/V width the model cannot take (head size 16) with a new cache
    cap leaves the cap as it was, and the refusal names kv_bits."""
    from engine.engine import Configure, Engine, EngineOptions, Status
    from engine.errors import EngineError
    engine = Engine(EngineOptions(model=str(tiny_gguf), cache_mib=64)).start()
    try:
        before = engine.call(Status(), timeout=60).parking
        with pytest.raises(EngineError, match="multiple of 32") as e:
            engine.call(Configure(kv_bits=8, cache_mib=7, cache_slots=1))
        assert e.value.reason == "kv_bits"
        assert engine.call(Status()).parking == before and engine.call(Status()).kv_bits == 16
    finally:
        engine.stop()


def test_the_modules_the_app_reads_import_no_mlx():
    """The app (which never imports mlx) reads the cache defaults and bounds and the sampling fields and
    their validation from the engine: those modules must stay plain Python at import."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, engine.limits as l, engine.sampling as s, engine.paths as p; "
            "s.SamplingParams(temperature=0.5, top_k=40).validate(); "
            "print(l.DEFAULT_CACHE_MIB, l.DEFAULT_CACHE_SLOTS, p.SESSION_EXTENSION); "
            "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules, sorted(sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1024", "4", ".stratasession"]


def test_one_source_for_the_cache_defaults():
    """EngineOptions, the CLI flags and the app's settings take the defaults from engine.limits."""
    import argparse

    from engine.frontends.launch import add_engine_flags
    from engine.engine import EngineOptions
    from engine.limits import DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    a = ap.parse_args([])
    o = EngineOptions()
    assert (a.conversation_cache_mib, a.conversation_cache_slots) == (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS)
    assert (o.cache_mib, o.cache_slots) == (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS)
