"""llama.cpp's libmtmd (the image half of llama.cpp, `llama_cpp.mtmd_cpp`) as an oracle, run in the
llama_oracle worker process (a native crash costs one test). The parent-side calls below send plain
data (paths, RGB bytes) and get numpy arrays back; the worker-side functions are registered in
llama_oracle's table through WORKER_FNS.

    chunks = mtmd_oracle.chunks(model, mmproj, "a <__media__> b", [rgb])   # [("text", ids), ("image", n)]
    embd = mtmd_oracle.encode(model, mmproj, rgb)                         # (n_tokens, n_embd) float32
    toks, logits = mtmd_oracle.greedy(model, mmproj, prompt, [rgb], 8)    # helper eval, then greedy
"""
from __future__ import annotations

import numpy as np

import llama_oracle

MARKER = "<__media__>"     # libmtmd's default media marker


def _rgb(a: np.ndarray) -> tuple[int, int, bytes]:
    a = np.ascontiguousarray(a, dtype=np.uint8)
    return int(a.shape[1]), int(a.shape[0]), a.tobytes()


def chunks(model, mmproj, text: str, images: list[np.ndarray], max_tokens: int = 0) -> list[tuple[str, object]]:
    """`max_tokens`: libmtmd's image_max_tokens (0: the projector type's default)."""
    return llama_oracle._request("fn", "mtmd_chunks", (str(model), str(mmproj), text,
                                                        [_rgb(i) for i in images], max_tokens), {})


def encode(model, mmproj, image: np.ndarray, max_tokens: int = 0) -> np.ndarray:
    return llama_oracle._request("fn", "mtmd_encode", (str(model), str(mmproj), _rgb(image), max_tokens), {})


def greedy(model, mmproj, text: str, images: list[np.ndarray], n: int) -> tuple[list[int], np.ndarray]:
    return llama_oracle._request("fn", "mtmd_greedy", (str(model), str(mmproj), text,
                                                        [_rgb(i) for i in images], n), {})


# ----------------------------------------------------------------------------------------- worker
class _Session:
    """One text model + mmproj loaded in the worker (kept between calls on the same pair)."""

    def __init__(self, model: str, mmproj: str, max_tokens: int = 0):
        import llama_cpp
        from llama_cpp import mtmd_cpp
        self.llama_cpp, self.mtmd = llama_cpp, mtmd_cpp
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2,
                                   verbose=False)
        p = mtmd_cpp.mtmd_context_params_default()
        p.use_gpu = False
        p.print_timings = False
        p.n_threads = 2
        p.warmup = False
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED   # f32 attention in the ViT
        if max_tokens:
            p.image_max_tokens = max_tokens
        self.ctx = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), self.llm._model.model, p)
        if not self.ctx:
            raise RuntimeError(f"mtmd_init_from_file refused {mmproj}")

    def tokenize(self, text: str, images):
        m = self.mtmd
        import ctypes
        bitmaps = [m.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * len(b)).from_buffer_copy(b)) for w, h, b in images]
        inp = m.mtmd_input_text()
        raw = text.encode()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), True, True
        chunks = m.mtmd_input_chunks_init()
        arr = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
        for b in bitmaps:
            m.mtmd_bitmap_free(b)
        if rc != 0:
            m.mtmd_input_chunks_free(chunks)
            raise RuntimeError(f"mtmd_tokenize: {rc}")
        return chunks

    def describe(self, chunks) -> list[tuple[str, object]]:
        import ctypes
        m, out = self.mtmd, []
        for i in range(m.mtmd_input_chunks_size(chunks)):
            c = m.mtmd_input_chunks_get(chunks, i)
            if m.mtmd_input_chunk_get_type(c) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                p = m.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out.append(("text", [int(p[j]) for j in range(n.value)]))
            else:
                out.append(("image", int(m.mtmd_input_chunk_get_n_tokens(c))))
        return out


_SESSIONS: dict[tuple[str, str, int], _Session] = {}


def _session(model: str, mmproj: str, max_tokens: int = 0) -> _Session:
    key = (model, mmproj, max_tokens)
    if key not in _SESSIONS:
        _SESSIONS[key] = _Session(model, mmproj, max_tokens)
    return _SESSIONS[key]


def _w_chunks(model, mmproj, text, images, max_tokens=0):
    s = _session(model, mmproj, max_tokens)
    ch = s.tokenize(text, images)
    try:
        return s.describe(ch)
    finally:
        s.mtmd.mtmd_input_chunks_free(ch)


def _w_encode(model, mmproj, image, max_tokens=0):
    s = _session(model, mmproj, max_tokens)
    m = s.mtmd
    ch = s.tokenize(MARKER, [image])
    try:
        for i in range(m.mtmd_input_chunks_size(ch)):
            c = m.mtmd_input_chunks_get(ch, i)
            if m.mtmd_input_chunk_get_type(c) != m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = int(m.mtmd_input_chunk_get_n_tokens(c))
                if m.mtmd_encode_chunk(s.ctx, c) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed")
                ptr = m.mtmd_get_output_embd(s.ctx)
                n_embd = s.llm.n_embd()
                return np.ctypeslib.as_array(ptr, shape=(n * n_embd,)).reshape(n, n_embd).copy()
        raise RuntimeError("no image chunk")
    finally:
        m.mtmd_input_chunks_free(ch)


def _w_greedy(model, mmproj, text, images, n):
    import ctypes
    s = _session(model, mmproj)
    m, lc, llm = s.mtmd, s.llama_cpp, s.llm
    llm.reset()
    llm._ctx.kv_cache_clear()
    ch = s.tokenize(text, images)
    try:
        new_n_past = lc.llama_pos(0)
        rc = m.mtmd_helper_eval_chunks(s.ctx, llm._ctx.ctx, ch, 0, 0, llm.n_batch, True, ctypes.byref(new_n_past))
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_eval_chunks: {rc}")
    finally:
        m.mtmd_input_chunks_free(ch)
    n_past, n_vocab = new_n_past.value, llm.n_vocab()
    toks, rows = [], []
    for _ in range(n):
        row = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
        rows.append(row)
        tok = int(np.argmax(row))
        toks.append(tok)
        batch = lc.llama_batch_get_one((lc.llama_token * 1)(tok), 1)
        if lc.llama_decode(llm._ctx.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        n_past += 1
    return toks, np.stack(rows)


WORKER_FNS = {"mtmd_chunks": _w_chunks, "mtmd_encode": _w_encode, "mtmd_greedy": _w_greedy}
