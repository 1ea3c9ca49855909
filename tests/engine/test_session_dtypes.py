"""Session files across compute dtypes: a float16 cache (a GPU's) is written straight from its memory and
read straight into its padded place; a float32 cache (the CPU's) goes through one cast each way. The file
is the same bytes either way, and a file restores into either engine."""
from __future__ import annotations

import pytest

from engine.engine import RestoreSession, SaveSession, Status
from test_parking import A_SYSTEM, ask, start, words
from engine_reads import while_held


def test_float16_and_float32_engines_write_the_same_file_and_read_each_other(tiny_gguf, tmp_path):
    f16 = start(tiny_gguf, cache_mib=64, dtype="float16")
    f32 = start(tiny_gguf, cache_mib=64, dtype="float32")
    try:
        msgs = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": words(50)}]
        ask(f16, msgs, "A", n=6)
        a = tmp_path / "from-f16.stratasession"
        r = f16.call(SaveSession(str(a)))
        assert r.profile["cast_ms"] < 50           # no cast: blocks written from the cache's memory
        n = f16.call(Status()).live_tokens
        # Into the float32 engine (one cast), then saved again (the other cast): the same bytes.
        r = f32.call(RestoreSession(str(a)))
        assert r.restored_tokens == n and r.profile["cast"] == "float16 -> float32"
        b = tmp_path / "from-f32.stratasession"
        f32.call(SaveSession(str(b)))
        assert a.read_bytes() == b.read_bytes()
        # And back into the float16 engine (no cast); its cache holds the file's values exactly.
        r = f16.call(RestoreSession(str(b)))
        assert r.profile["cast"] == "none (float16 file, float16 cache)"

        def padded(e):
            c = e.conversations.live.cache[0]
            return [c.keys.shape[2], c.offset, str(c.keys.dtype)]
        cells, offset, dtype = while_held(f16, padded)
        assert offset == n and cells % 256 == 0 and cells > n and dtype == "mlx.core.float16"
        c = tmp_path / "again.stratasession"
        f16.call(SaveSession(str(c)))
        assert c.read_bytes() == a.read_bytes()
        # Both continue the conversation from the restored cache.
        for e in (f16, f32):
            out, _ = ask(e, msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                         "A", n=2)
            assert out.generated_tokens == 2
    finally:
        f16.stop()
        f32.stop()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_gpu_restore_path_gives_the_in_place_restore_s_cache(tiny_gguf, tmp_path, monkeypatch, dtype):
    """A GPU's restore (tensors read into padded float16 buffers by reader threads, hashed in file
    order by a third, copied to the device through MLX's Load primitive as on CUDA, cast there when the
    cache is not float16), forced here on the CPU, continues the conversation exactly as the CPU's
    in-place restore does, and its cache saves to the same bytes (the save reading device copies, as
    on CUDA: device_upload.host_view)."""
    import engine.model.device_upload as device_upload
    import engine.session_files.sessions as sessions
    e = start(tiny_gguf, cache_mib=64, dtype=dtype)
    try:
        msgs = [{"role": "system", "content": A_SYSTEM}, {"role": "user", "content": words(60)}]
        first, _ = ask(e, msgs, "A", n=6)
        src = tmp_path / "a.stratasession"
        e.call(SaveSession(str(src)))
        more = msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": words(9, 7)}]
        outs, files = [], []
        for gpu in (False, True):
            monkeypatch.setattr(sessions, "on_gpu", lambda: gpu)
            monkeypatch.setattr(device_upload, "on_cuda", lambda: gpu)
            r = e.call(RestoreSession(str(src), conversation="A"))
            out, _ = ask(e, more, "A", n=5, temperature=0.0)
            assert out.cached_tokens > 0.9 * r.restored_tokens > 0      # the follow-up read the restored K/V
            outs.append(out.tokens)
            files.append(tmp_path / f"gpu-{gpu}.stratasession")
            e.call(SaveSession(str(files[-1])))
        assert outs[0] == outs[1] and len(outs[0]) == 5
        assert files[0].read_bytes() == files[1].read_bytes()
    finally:
        e.stop()
