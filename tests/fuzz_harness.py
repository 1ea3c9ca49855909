"""The parent side of the fuzz suite: a killable worker, seeded GGUF mutators, hostile templates.

No fuzzing library: the mutators are small and seeded (random.Random(seed)), so a failing input is
reproduced from its seed and index alone.
"""
from __future__ import annotations

import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "fuzz_worker.py"
MEMORY_CAP = 1 << 30          # RLIMIT_AS of the worker: a tiny model loads in ~300 MB of address space


@dataclass
class Tally:
    tried: int = 0
    accepted: int = 0
    refused: int = 0
    crashes: list[str] = field(default_factory=list)     # "what: detail" of each crash, hang or death
    peak_rss: int = 0

    def add(self, what: str, outcome: dict) -> None:
        self.tried += 1
        kind = outcome["outcome"]
        if kind == "accepted":
            self.accepted += 1
        elif kind == "refused":
            self.refused += 1
        else:
            self.crashes.append(f"{what}: {kind}: {outcome.get('detail', '')[-600:]}")

    def line(self, name: str) -> str:
        return (f"{name}: {self.tried} tried, {self.refused} refused, {self.accepted} accepted, "
                f"{len(self.crashes)} crashes, peak RSS {self.peak_rss >> 20} MiB")


class Worker:
    """tests/fuzz_worker.py in a child process under RLIMIT_AS; killed and restarted on a hang."""

    def __init__(self, cap: int = MEMORY_CAP, env: dict | None = None):
        self.cap, self.env = cap, env
        self.proc: subprocess.Popen | None = None
        self.peak_rss = 0

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), **(self.env or {})}
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(self.cap)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=env, cwd=str(REPO))
        ready = self._read(120.0)
        if ready is None or not ready.get("ready"):
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.05))
            try:
                self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)
            except psutil.Error:
                pass
            if r:
                line = self.proc.stdout.readline()
                return json.loads(line) if line else {"outcome": "died", "detail": f"exit {self.proc.wait()}"}

    def run(self, job: dict, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return {"outcome": "died", "detail": "the worker died before the job"}
        out = self._read(timeout)
        if out is None:
            self.close()
            return {"outcome": "hang", "detail": f"no answer in {timeout} s"}
        if out.get("outcome") == "died":
            self.close()
        return out

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


# ---- GGUF mutants ------------------------------------------------------------------------------
@dataclass
class GGUFLayout:
    """Byte offsets in a GGUF header, found with gguf-py on the (valid) original."""
    size: int
    header_end: int                                   # start of the tensor data
    values: dict[str, tuple[int, int]]                # key -> (offset of its value, value type)
    type_offsets: dict[str, int]                      # key -> offset of its type field
    tensor_infos: list[tuple[str, int]]               # (name, offset of n_dims)


def layout(path: Path) -> GGUFLayout:
    from gguf import GGUFReader
    r = GGUFReader(path)
    values, types = {}, {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        klen = len(key.encode())
        types[key] = f.offset + 8 + klen
        values[key] = (f.offset + 12 + klen, int(f.types[0]))
    infos = []
    for t in r.tensors:
        infos.append((t.name, t.field.offset + 8 + len(t.name.encode())))
    return GGUFLayout(path.stat().st_size, int(r.data_offset), values, types, infos)


def _patch(data: bytearray, offset: int, fmt: str, value) -> None:
    struct.pack_into("<" + fmt, data, offset, value)


def targeted_mutants(original: bytes, lay: GGUFLayout, arch: str = "llama") -> list[tuple[str, bytes]]:
    """The mutants of the issue's report, and their neighbours: each (label, file bytes)."""
    out = []

    def put(label, key, fmt, value):
        if key in lay.values:
            d = bytearray(original)
            _patch(d, lay.values[key][0], fmt, value)
            out.append((label, bytes(d)))

    for v in (131074, 2**32 - 1, 0, 1, 3):
        put(f"block_count={v}", f"{arch}.block_count", "I", v)
    for v in (0, 3, 7, 2**31, 2**32 - 1):
        put(f"head_count={v}", f"{arch}.attention.head_count", "I", v)
    for v in (0, 3, 2**32 - 1):
        put(f"head_count_kv={v}", f"{arch}.attention.head_count_kv", "I", v)
    for v in (0, 63, 2**31, 2**32 - 1):
        put(f"embedding_length={v}", f"{arch}.embedding_length", "I", v)
    for v in (0, 2**31):
        put(f"feed_forward_length={v}", f"{arch}.feed_forward_length", "I", v)
    for v in (0, 2**32 - 1):
        put(f"context_length={v}", f"{arch}.context_length", "I", v)
    for v in (0.0, -1e-5, float("nan"), float("inf"), 1e30):
        put(f"rms_eps={v}", f"{arch}.attention.layer_norm_rms_epsilon", "f", v)
    for v in (0.0, float("nan"), -1.0):
        put(f"rope_freq_base={v}", f"{arch}.rope.freq_base", "f", v)
    for v in (10**8, 2**40, 2**63, 2**64 - 1):
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key in lay.values:
                d = bytearray(original)
                _patch(d, lay.values[key][0] + 4, "Q", v)          # after the element type
                out.append((f"{key} count={v}", bytes(d)))
    for v in (2**40, 2**63, 10**6):
        for key in ("general.name", "tokenizer.chat_template", "general.architecture"):
            if key in lay.values:
                d = bytearray(original)
                _patch(d, lay.values[key][0], "Q", v)
                out.append((f"{key} length={v}", bytes(d)))
    for key, t in (("general.architecture", 9), ("general.architecture", 4), (f"{arch}.block_count", 8),
                   (f"{arch}.block_count", 9), ("tokenizer.ggml.tokens", 8), ("tokenizer.ggml.token_type", 6),
                   (f"{arch}.attention.head_count", 6), ("tokenizer.ggml.bos_token_id", 8), (f"{arch}.block_count", 77)):
        if key in lay.type_offsets:
            d = bytearray(original)
            _patch(d, lay.type_offsets[key], "I", t)
            out.append((f"{key} retyped to {t}", bytes(d)))
    for key in ("general.architecture", "general.name", "tokenizer.chat_template", "tokenizer.ggml.model"):
        if key in lay.values:
            d = bytearray(original)
            d[lay.values[key][0] + 8] = 0xFF                        # first byte of the string
            out.append((f"{key} invalid UTF-8", bytes(d)))
    if "tokenizer.ggml.tokens" in lay.values:
        d = bytearray(original)
        d[lay.values["tokenizer.ggml.tokens"][0] + 12 + 8] = 0xC3   # a lone UTF-8 lead byte in token 0
        out.append(("token 0 invalid UTF-8", bytes(d)))
    for v in (0xFFFFFFFF, 2**62):
        for off, what in ((8, "tensor_count"), (16, "kv_count")):
            d = bytearray(original)
            _patch(d, off, "Q", v)
            out.append((f"{what}={v}", bytes(d)))
    for name, off in lay.tensor_infos[:3]:
        for fmt, rel, v, what in (("I", 0, 100, "n_dims=100"), ("I", 0, 0, "n_dims=0"),
                                  ("Q", 4, 2**62, "dim0=2^62"), ("Q", 4, 0, "dim0=0")):
            d = bytearray(original)
            _patch(d, off + rel, fmt, v)
            out.append((f"{name} {what}", bytes(d)))
    for cut in (3, 10, 24, 200, lay.header_end // 2, lay.header_end - 1, lay.header_end + 10, lay.size - 1):
        out.append((f"truncated at {cut}", original[:cut]))
    return out


_INTERESTING32 = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 131074)


def random_mutant(original: bytes, lay: GGUFLayout, rng: random.Random) -> tuple[str, bytes]:
    """One seeded mutation of the header (bit flips, interesting values, byte runs, truncation)."""
    d = bytearray(original)
    kind = rng.random()
    end = lay.header_end
    if kind < 0.45:
        n = rng.choice((1, 1, 1, 2, 4, 8))
        spots = [rng.randrange(4, end) for _ in range(n)]
        for s in spots:
            d[s] ^= 1 << rng.randrange(8)
        return f"flip {spots}", bytes(d)
    if kind < 0.7:
        # an interesting value written into a value / count / length field
        key = rng.choice(list(lay.values))
        off, vtype = lay.values[key]
        if vtype in (8, 9):
            off += 4 if vtype == 9 else 0
            v = rng.choice((0, 1, 2**31, 2**32, 2**40, 2**63, 2**64 - 1, rng.randrange(2**64)))
            _patch(d, off, "Q", v)
        else:
            v = rng.choice(_INTERESTING32)
            _patch(d, off, "I", v)
        return f"{key}={v}", bytes(d)
    if kind < 0.85:
        s = rng.randrange(4, end - 8)
        n = rng.randrange(1, 9)
        b = rng.choice((0x00, 0xFF, 0x7F, 0x80))
        d[s:s + n] = bytes([b]) * n
        return f"bytes {s}+{n}={b:#x}", bytes(d)
    if kind < 0.93:
        # retype a random key
        key = rng.choice(list(lay.type_offsets))
        t = rng.randrange(0, 14)
        _patch(d, lay.type_offsets[key], "I", t)
        return f"{key} type={t}", bytes(d)
    cut = rng.randrange(4, lay.size)
    return f"truncate {cut}", bytes(d[:cut])


# ---- templates ---------------------------------------------------------------------------------
HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'a' * 10**9 }}",
    "{{ messages|tojson(indent=10**8) }}",
    "{{ messages|tojson(indent=100) }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% include 'other.jinja' %}",
    "{% import 'x' as y %}",
    "{% extends 'base' %}",
    "{{ range(10**9)|list }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '{:999999999}'.format(1) }}",
    "{{ '{0:>{1}}'.format(1, 10**9) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'|indent(10**9) }}",
    "{{ ('a' * 1000000)|wordwrap(1) }}",
    "{{ 10 ** 10 ** 10 }}",
    "{{ 2 ** 100000000 }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception('refused by the template') }}",
    "{% for",
    "{{ messages[0]['content'] | undefined_filter }}",
    "{{ 1 / 0 }}",
    "{{ messages[100]['content'] }}",
    "{{ strftime_now('%Y' * 100000) }}",
    "{% for m in messages %}{{ m.content * 1000 }}{% endfor %}",
    "{{ (messages * 100000) | map(attribute='content') | join(',') }}",
    "{{ lipsum(n=10**6) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ 'x' | truncate(10**12) }}",
    "{{ '%s' | format('a' * 10**6) * 100 }}",
]

_PIECES = ["{{ ", " }}", "{% for m in messages %}", "{% endfor %}", "{% if ", " %}", "{% endif %}",
           "{% set x = ", "m['content']", "messages", "range(", ")", " * ", " + ", " ~ ", "10**", "9", "'a'",
           "|tojson(indent=", "|length", "|list", "|join(', ')", "loop.index", "add_generation_prompt",
           "bos_token", "{% macro f(n) %}", "{% endmacro %}", "f(", "namespace(", "[", "]", "(", ",", "'",
           "\"", "{#", "#}", "%}", "}}", "{{", "raise_exception('x')", "|upper", "|indent(", "|center(", "1000000"]


def random_template(rng: random.Random) -> str:
    """A template of random pieces: often a syntax error, sometimes a loop or a large value."""
    return "".join(rng.choice(_PIECES) for _ in range(rng.randrange(1, 24)))
