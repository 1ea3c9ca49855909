"""8/4-bit K/V (issue 15): generation, parking's byte count, session files (format in the
fingerprint, refused across formats), speculation's trim on a quantized cache. Real engine, tiny GGUFs
(tiny_gguf_wide: head size 32, the smallest a quantization group takes)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.cache import kv_format
from engine.engine import Configure, Engine, EngineOptions, GenerateRequest, RestoreSession, SaveSession, Status
from engine.errors import StrataError
from engine.sampling import SamplingParams
from gguf_factory import TRAINING_TEXT
from engine_reads import while_held

WORDS = TRAINING_TEXT.split()


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def start(model, **opts) -> Engine:
    e = Engine(EngineOptions(model=str(model), **opts)).start()
    assert e.call(Status(), timeout=120).model
    return e


def gen(e, msgs, n=16, spec="off", temperature=0.8, seed=1, rep=1.0):
    sp = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, repetition_penalty=rep)
    return e.call(GenerateRequest(messages=list(msgs), sampling=sp, speculative=spec), timeout=300)


def test_choose_and_labels():
    assert kv_format.choose(16, 64).label == "float16"
    assert kv_format.choose(8, 64).label == "q8g64"
    assert kv_format.choose(4, 96).label == "q4g32"
    with pytest.raises(StrataError, match="multiple of 32"):
        kv_format.choose(8, 16)
    with pytest.raises(StrataError, match="one of 16, 8, 4"):
        kv_format.choose(6, 64)
    for label in ("float16", "q8g64", "q4g32"):
        assert kv_format.format_of_label(label).label == label
    assert kv_format.format_of_label("q3g64") is None


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_parks_with_its_real_bytes(tiny_gguf_wide, bits):
    from mlx_lm.models.cache import QuantizedKVCache
    e = start(tiny_gguf_wide, kv_bits=bits)
    a = [{"role": "user", "content": words(60)}]
    ra = gen(e, a)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in e.conversations.live.cache)
    live = e.conversations.live
    real = sum(x.nbytes for c in live.cache for x in (*c.keys, *c.values))
    gen(e, [{"role": "user", "content": words(20, 40)}])              # side request parks A
    st = e.call(Status())
    assert st.parking["entries"] == 1 and st.parking["bytes"] == real == live.nbytes()
    e16 = start(tiny_gguf_wide)
    gen(e16, a)
    assert e16.conversations.live.nbytes() > real * (1.7 if bits == 8 else 2.8)      # codes + scales vs float32 K/V
    a2 = a + [{"role": "assistant", "content": ra.text}, {"role": "user", "content": words(8, 3)}]
    r2 = gen(e, a2)
    assert r2.cached_tokens >= ra.prompt_tokens                    # resumed from the parked K/V


@pytest.mark.parametrize("upload", ["mx.array", "load-primitive"])
def test_quantized_session_round_trip_and_format_refusal(tiny_gguf_wide, tmp_path, monkeypatch, upload):
    """load-primitive: the restore's arrays come through MLX's Load primitive, as on CUDA (forced)."""
    import engine.model.device_upload as device_upload
    monkeypatch.setattr(device_upload, "on_cuda", lambda: upload == "load-primitive")
    a = [{"role": "user", "content": words(50)}]
    e8 = start(tiny_gguf_wide, kv_bits=8)
    r1 = gen(e8, a)
    path = tmp_path / "q8.stratasession"
    saved = e8.call(SaveSession(str(path)))
    from engine.session_files.sessions import read_header
    table, meta, _ = read_header(str(path))
    assert meta["kv_dtype"] == "q8g32" and meta["fp.kv_format"] == "q8g32"
    assert table["k.0.q"]["dtype"] == "U32" and table["k.0.s"]["dtype"] == "F16"
    a2 = a + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": words(6, 9)}]
    cont = gen(e8, a2, seed=4)
    fresh = start(tiny_gguf_wide, kv_bits=8)
    r = fresh.call(RestoreSession(str(path)))
    assert r.restored_tokens == saved.tokens
    again = gen(fresh, a2, seed=4)
    assert again.tokens == cont.tokens and again.cached_tokens == cont.cached_tokens
    # another format: refused with the reason, the live conversation untouched
    e16 = start(tiny_gguf_wide)
    gen(e16, a)
    before = list(e16.conversations.live.tokens)
    with pytest.raises(StrataError, match=r"holds 8-bit K/V \(group 32\); this engine runs 16-bit K/V"):
        e16.call(RestoreSession(str(path)))
    assert e16.conversations.live.tokens == before
    p16 = tmp_path / "f16.stratasession"
    e16.call(SaveSession(str(p16)))
    with pytest.raises(StrataError, match=r"holds 16-bit K/V; this engine runs 4-bit K/V"):
        start(tiny_gguf_wide, kv_bits=4).call(RestoreSession(str(p16)))
    # a 16-bit file still restores in a 16-bit engine (format unchanged for them)
    assert start(tiny_gguf_wide).call(RestoreSession(str(p16))).restored_tokens == len(before)


def test_configure_switches_format_for_new_conversations(tiny_gguf_wide, tiny_gguf):
    e = start(tiny_gguf_wide)
    a = [{"role": "user", "content": words(40)}]
    gen(e, a)
    e.call(Configure(kv_bits=8))
    r = gen(e, a)
    assert r.cached_tokens == 0                    # the 16-bit K/V is not reused under 8 bits
    assert hasattr(e.conversations.live.cache[0], "bits")
    with pytest.raises(StrataError, match="one of 16, 8, 4"):
        e.call(Configure(kv_bits=5))
    small = start(tiny_gguf)                           # head size 16
    with pytest.raises(StrataError, match="multiple of 32"):
        small.call(Configure(kv_bits=8))


def test_speculation_trims_a_quantized_cache_exactly(tiny_gguf_wide):
    e = start(tiny_gguf_wide, kv_bits=8, cache_mib=0)
    msgs = [{"role": "user", "content": words(40) + " again: " + words(40)}]
    plain = gen(e, msgs, n=40, temperature=0.0, rep=1.6)
    for spec in ("lookup", f"draft:{e.model_path}"):
        r = gen(e, msgs, n=40, spec=spec, temperature=0.0, rep=1.6)
        assert r.tokens == plain.tokens, spec
        assert all(c.offset == len(e.conversations.live.tokens) for c in e.conversations.live.cache)


@pytest.mark.slow
def test_smollm2_session_bytes_per_token_at_8_bits(real_model, tmp_path):
    e = start(real_model, kv_bits=8)
    r = gen(e, [{"role": "user", "content": "Explain in detail how a refrigerator works. " * 12}], n=8)
    s = e.call(SaveSession(str(tmp_path / "s.stratasession")))
    per_token = s.session_bytes / s.tokens
    # 30 layers x 3 K/V heads x 64: 11,520 B of 8-bit codes + 720 B of float16 scales/biases
    assert per_token <= 12_500, per_token
    assert s.tokens >= r.prompt_tokens


def test_kv_bits_a_model_cannot_take_is_refused_at_load(tiny_gguf, tiny_gguf_wide):
    from engine.engine import LoadModel
    e = start(tiny_gguf_wide, kv_bits=8)
    with pytest.raises(StrataError, match=r"8-bit K/V needs a head size that is a multiple of 32 \(this model's is 16\)"):
        e.call(LoadModel(str(tiny_gguf)))
    assert e.call(Status()).model == str(tiny_gguf_wide)     # the loaded model keeps serving
    assert gen(e, [{"role": "user", "content": "hi"}], n=3).tokens


# ---- quantized session files against damaged and crafted input (the format-2 guarantees) ----------

@pytest.fixture(scope="module")
def q_conv(tiny_gguf_wide, tmp_path_factory):
    d = tmp_path_factory.mktemp("q-sessions")
    e = start(tiny_gguf_wide, kv_bits=4, cache_mib=64)
    gen(e, [{"role": "user", "content": words(45)}], n=8)
    good = d / "q4.stratasession"
    e.call(SaveSession(str(good)))
    yield {"engine": e, "dir": d, "good": good, "raw": good.read_bytes()}
    e.stop()


def test_quantized_file_layout_bytes_and_exact_restore(q_conv):
    from engine.session_files import session_quant, sessions
    from test_session_refusals import assemble, split
    e, raw = q_conv["engine"], q_conv["raw"]
    head, data = split(raw)
    assert assemble(head, data) == raw                 # the documented checksum, byte for byte
    meta = head["__metadata__"]
    n = int(meta["n_tokens"])
    assert (meta["kv_dtype"], meta["fp.kv_format"], meta["kv_layout"]) == ("q4g32", "q4g32", session_quant.QUANT_LAYOUT)
    # tiny_gguf_wide: 3 layers x 2 K/V heads x 32 -> 4-bit codes 4 uint32 + 1 scale + 1 bias per head
    assert [k for k in head if k.startswith("k.0")] == ["k.0.q", "k.0.s", "k.0.b"]
    assert head["k.0.q"] == {"dtype": "U32", "shape": [1, 2, n, 4], "data_offsets": [4 * n, 4 * n + 32 * n]}
    assert head["v.2.b"]["dtype"] == "F16" and head["v.2.b"]["shape"] == [1, 2, n, 1]
    assert len(data) == 4 * n + n * 3 * 2 * 2 * (4 * 4 + 2 + 2)

    def held(eng):
        live = eng.conversations.live
        return [[np.asarray(x[..., :n, :]).tobytes() for x in (*l.keys, *l.values)] for l in live.cache], live.nbytes()
    before, _ = while_held(e, held)
    r = e.call(RestoreSession(str(q_conv["good"])))
    assert r.restored_tokens == n
    after, real = while_held(e, held)
    assert after == before                            # codes, scales and biases bit for bit
    g = while_held(e, lambda eng: sessions.Geometry.of(eng.sessions.fingerprint()))
    assert session_quant.restore_bytes(n, g) == real  # the memory guard is asked for the real bytes
    again = q_conv["dir"] / "again.stratasession"
    e.call(SaveSession(str(again)))
    assert again.read_bytes() == raw


def test_quantized_header_flips_are_refused_in_one_line(q_conv):
    import struct
    from test_session_refusals import _flips, restore_all
    raw = q_conv["raw"]
    (n,) = struct.unpack("<Q", raw[:8])
    outcomes = restore_all(q_conv["engine"], q_conv["dir"] / "flip.stratasession", _flips(raw, range(8 + n)))
    assert not [o for o in outcomes if o.startswith("CRASH")]
    assert outcomes.count("OK") == 0 and all("\n" not in o for o in outcomes)
    # and the data: codes, scales and biases are all under the checksum
    positions = range(8 + n, len(raw), max(1, (len(raw) - 8 - n) // 150))
    outcomes = restore_all(q_conv["engine"], q_conv["dir"] / "data.stratasession",
                           _flips(raw, positions) + [raw[:-1], raw + b"\0" * 8])
    assert outcomes.count("OK") == 0 and not [o for o in outcomes if o.startswith("CRASH")]
    assert sum(o.endswith("is corrupted (checksum mismatch)") for o in outcomes) == len(positions)


def test_crafted_quantized_files_with_a_valid_checksum_are_refused(q_conv):
    import json
    from test_session_refusals import assemble, restore_all, split
    head, data = split(q_conv["raw"])
    n = int(head["__metadata__"]["n_tokens"])

    def edit(fn):
        h = json.loads(json.dumps(head))
        fn(h)
        return assemble(h, data)
    table = "its tensor table does not match"
    cases = {
        "codes width doubled": (edit(lambda h: h["k.0.q"].update(shape=[1, 2, n, 8])), table),
        "scales F32": (edit(lambda h: h["v.1.s"].update(dtype="F32")), table),
        "biases missing": (edit(lambda h: h.pop("k.2.b")), table),
        "scales and biases swapped": (edit(lambda h: h.update({"k.0.s": h["k.0.b"], "k.0.b": h["k.0.s"]})), table),
        "a 16-bit table": (edit(lambda h: [h.pop(k) for k in list(h) if k[:2] in ("k.", "v.")]
                                and h.update({f"{kind}.{i}": {"dtype": "F16", "shape": [1, 2, n, 32],
                                                              "data_offsets": [0, 0]}
                                              for i in range(3) for kind in "kv"})), table),
        "kv_dtype q8g32 under a q4 fingerprint": (edit(lambda h: h["__metadata__"].update(kv_dtype="q8g32")),
                                                  ": incompatible K/V layout (q8g32"),
        "16-bit layout name": (edit(lambda h: h["__metadata__"].update(
            kv_layout="mlx-kvcache (batch, kv_heads, tokens, head_dim)")), ": incompatible K/V layout"),
        "fingerprint says 8 bits": (edit(lambda h: h["__metadata__"].update(kv_dtype="q8g32", **{"fp.kv_format": "q8g32"})),
                                    "holds 8-bit K/V (group 32); this engine runs 4-bit K/V (group 32)"),
        "fingerprint names no format": (edit(lambda h: h["__metadata__"].update(**{"fp.kv_format": "q9"})),
                                        "holds K/V format 'q9'; this engine runs 4-bit K/V"),
    }
    outcomes = restore_all(q_conv["engine"], q_conv["dir"] / "crafted.stratasession", [b for b, _ in cases.values()])
    for (case, (_, want)), got in zip(cases.items(), outcomes):
        assert want in got, (case, got)
        assert got.startswith("crafted.stratasession") and "\n" not in got, (case, got)
