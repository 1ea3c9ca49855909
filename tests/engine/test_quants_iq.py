"""The IQ and ternary types: decoded exactly (equal to gguf-py's decoder and to llama.cpp's own, ggml's
to_float), held in their chosen MLX form within its stated error, and tiny models quantized by llama.cpp's
own quantizer generate as llama.cpp does under the parity tests' margin rule.

The files come from llama.cpp's quantizer (llama_model_quantize in the oracle's worker), with the tiny
model's importance matrix (tests/gguf_factory_iq.py): every type, IQ2_*/IQ1_* included, is made the way
a user's file is.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType as T
from gguf import quants as gq

import llama_oracle
from engine.model import quants

if not llama_oracle.available():
    pytest.skip("llama-cpp-python (the llama.cpp oracle) is not installed", allow_module_level=True)

from gguf_factory_iq import TEXTS, quantized_tiny  # noqa: E402
from llama_oracle import strata_logits  # noqa: E402

pytestmark = pytest.mark.oracle

# type -> the llama.cpp file type that makes it (IQ2_S files come from the IQ2_M mix, IQ2_XS's from IQ2_S)
FTYPE_OF = {"IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S",
            "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_M", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M",
            "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0"}
EXACT_FORMS = {"IQ4_NL": 8, "IQ4_XS": 8, "IQ3_S": 4, "IQ3_XXS": 6, "IQ2_XXS": 8, "IQ1_S": 2, "TQ1_0": 2,
               "TQ2_0": 2}
TIE_MARGIN = 0.6            # as tests/engine/test_oracle.py: llama.cpp's own 8-bit activations move logits so


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    yield tmp_path_factory.mktemp("iq")
    llama_oracle.shutdown()


def _pure(folder, name):
    return quantized_tiny(folder, FTYPE_OF[name], pure=True)


def _matrices(path, name):
    ts = [t for t in GGUFReader(str(path)).tensors if len(t.shape) == 2 and t.tensor_type == T[name]]
    assert len(ts) >= 7, [t.tensor_type.name for t in GGUFReader(str(path)).tensors]
    return ts


def _held(m) -> np.ndarray:
    return np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits))


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_decode_equals_gguf_py_and_llama_cpp(folder, name):
    """Strata's exact decode (chunked, gguf-py's block decoders) is bit-equal to gguf.quants.dequantize
    and to llama.cpp's own to_float on every matrix of a file llama.cpp quantized."""
    for t in _matrices(_pure(folder, name), name):
        ours = quants.decode_exact(t)
        out_f, in_f = ours.shape
        ref = np.asarray(gq.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(out_f, in_f)
        np.testing.assert_array_equal(ours, ref, err_msg=t.name)
        native = llama_oracle.ggml_dequantize(int(t.tensor_type), np.asarray(t.data).tobytes(), ours.size)
        np.testing.assert_array_equal(ours, native.reshape(ours.shape), err_msg=t.name)


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_held_form_within_its_stated_error(folder, name):
    """Lattice and ternary types are held exactly (float rounding only); the others (16-value scales)
    within one step of an 8-bit requantization of each group of 32."""
    qtype = T[name]
    for t in _matrices(_pure(folder, name), name):
        m = quants.convert_tensor(t)
        exact = quants.decode_exact(t)
        assert m.bits == quants.HELD_BITS[qtype] and m.group_size == 32
        err = np.abs(_held(m) - exact)
        if name in EXACT_FORMS:
            assert m.bits == EXACT_FORMS[name] and m.note.endswith("(exact)"), m.note
            assert err.max() <= 1e-6 * np.abs(exact).max(), (t.name, err.max())
        else:
            assert m.note.endswith("(requantized)"), m.note
            g = exact.reshape(exact.shape[0], -1, 32)
            step = (g.max(-1) - g.min(-1)) / (2 ** m.bits - 1)
            assert (err.reshape(g.shape).max(-1) <= step * (128 / 127.5) + 1e-7).all(), t.name


def test_damaged_lattice_block_falls_back_to_requantization(folder):
    """A block whose scale is NaN is off any lattice: it is requantized (with MLX's own handling), never
    packed wrong, and the note says so."""
    (t, *_) = _matrices(_pure(folder, "IQ4_NL"), "IQ4_NL")
    blocks = np.array(t.data).reshape(-1, GGML_QUANT_SIZES[T.IQ4_NL][1])
    blocks[0, 0:2] = np.array([np.float16(np.nan)]).view(np.uint8)

    class Damaged:
        name, tensor_type, shape, data = t.name, t.tensor_type, t.shape, blocks.reshape(np.asarray(t.data).shape)

    m = quants.convert_tensor(Damaged())
    assert m.note == "IQ4_NL -> 8-bit affine g32 (requantized)"


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_tiny_model_generates_as_llama_cpp(folder, name):
    """llama.cpp's own mix for the file type (realistic: some tensors in other types), greedy parity by
    teacher forcing: a different pick only where llama.cpp's own top-2 margin is below TIE_MARGIN."""
    path = quantized_tiny(folder, FTYPE_OF[name])
    assert any(t.tensor_type == T[name] for t in GGUFReader(str(path)).tensors)
    for text in TEXTS[:2]:
        differ, margins = _teacher_forced_disagreements(path, text, 12)
        assert all(mg < TIE_MARGIN for mg in margins), (name, text, differ, margins)

def _teacher_forced_disagreements(path, text: str, n: int):
    llm = llama_oracle.cached_llama(path)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)[:12]
    seq = ids + llama_oracle.greedy(llm, ids, n)
    ref, ours = llama_oracle.logits(llm, seq)[:-1], strata_logits(path, seq)[:-1]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    differ = np.nonzero(ref.argmax(-1) != ours.argmax(-1))[0]
    return differ.tolist(), (top2[differ, 1] - top2[differ, 0]).tolist()


@pytest.mark.parametrize("ftype", ["IQ4_XS", "IQ3_S", "TQ2_0"])
def test_expert_stacks_generate_as_llama_cpp(tmp_path, ftype):
    """A tiny qwen3moe quantized by llama.cpp: the 3-D expert stacks go through the same decode and
    held forms (no importance matrix: these types do not need one)."""
    from gguf_factory import quantize_with_llama, write_tiny_moe_gguf
    src = write_tiny_moe_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_expert=4, seed=5)
    path = quantize_with_llama(src, tmp_path / f"moe-{ftype}.gguf", ftype)
    stacks = [t for t in GGUFReader(str(path)).tensors if len(t.shape) == 3]
    assert stacks and any(t.tensor_type == T[ftype] for t in stacks), [t.tensor_type.name for t in stacks]
    for text in TEXTS[:2]:
        differ, margins = _teacher_forced_disagreements(path, text, 12)
        assert all(mg < TIE_MARGIN for mg in margins), (ftype, text, differ, margins)


def _params_bytes(model) -> int:
    from mlx.utils import tree_flatten
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", list(FTYPE_OF))
def test_estimate_and_model_list_show_honest_bytes(folder, name):
    """The estimate's weights are what MLX holds once loaded; the model list's bits per weight are the
    file's tensor bytes and those held bytes over the weight count."""
    from app.gguf_meta import read_meta
    from engine.model import memory_estimate as me
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    path = _pure(folder, name)
    model, _ = load_model(open_gguf(path))
    held = _params_bytes(model)
    assert me.estimate(me.read_header(path), 256, "float32").weights_bytes == held
    tensors = GGUFReader(str(path)).tensors
    n = sum(int(t.n_elements) for t in tensors)
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    meta = read_meta(path)                       # the platform's dtype: float32 off the Mac
    assert meta.file_bpw == pytest.approx(8 * file_bytes / n) and meta.held_bpw == pytest.approx(8 * held / n)
    assert meta.held_bpw < 32 - 4          # never the dense size: held quantized
