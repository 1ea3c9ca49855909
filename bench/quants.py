"""Held forms of the GGUF types Strata decodes (IQ, TQ, Q6_K/Q3_K/Q2_K): bytes held per weight and what
each candidate form loses, on tiny models quantized by llama.cpp's own quantizer.

For each type: a tiny llama (2 layers, width 256, random weights) quantized "pure" (every 2-D tensor in
the type) with the tiny model's importance matrix (tests/gguf_factory_iq.py), then for each candidate
MLX form (affine g32 at 2/3/4/5/6/8 bits):

* weights: max and RMS of (held - exact decode) over every 2-D tensor, relative to the RMS of the exact
  weights (the exact decode is gguf-py's, checked equal to llama.cpp's by tests/engine/test_quants_iq.py);
* bytes held per weight with float16 scales and biases (the Mac's compute dtype), and the file's;
* next-token distributions on four short texts (every position) against llama.cpp on the same file:
  top-1 agreement, mean KL(llama.cpp || Strata), the largest |logit difference|; and against Strata
  holding the exact decode (dense float32: the error the held form alone adds).

    python bench/quants.py                          # every type, its candidate forms
    python bench/quants.py --types IQ4_XS Q6_K      # some types
    python bench/quants.py --sizes                  # also held/file ratios of Q4_K_M ... IQ4_XS files
    python bench/quants.py --types --file real-Q6_K.gguf --file-type Q6_K   # a real file's Q6_K tensors
    python bench/quants.py --types --size-files a.gguf b.gguf               # held/file ratios of files
    python bench/quants.py --types --size-from model-F16.gguf   # ... of its Q4_K_M ... IQ4_XS quantizations

Needs llama-cpp-python (the oracle). Prints a table and appends one figure line per type and form.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

import llama_oracle  # noqa: E402
from bench.harness import Run, add_args  # noqa: E402
from engine.model import memory_estimate, quants  # noqa: E402
from engine.model.gguf_file import open_gguf  # noqa: E402
from engine.model.model_loader import load_model  # noqa: E402
from gguf_factory import quantize_with_llama  # noqa: E402
from gguf_factory_iq import TEXTS, quantized_tiny  # noqa: E402

# type -> (llama.cpp file type that makes it, candidate held bits)
TYPES = {
    "IQ4_NL": ("IQ4_NL", (4, 5, 6, 8)), "IQ4_XS": ("IQ4_XS", (4, 5, 6, 8)),
    "IQ3_XXS": ("IQ3_XXS", (4, 5, 6, 8)), "IQ3_S": ("IQ3_S", (4, 5, 6, 8)),
    "IQ2_XXS": ("IQ2_XXS", (3, 4, 5, 6, 8)), "IQ2_XS": ("IQ2_XS", (3, 4, 5, 6, 8)),
    "IQ2_S": ("IQ2_M", (3, 4, 5, 6, 8)), "IQ1_S": ("IQ1_S", (2, 3, 4, 5, 6, 8)),
    "IQ1_M": ("IQ1_M", (3, 4, 5, 6, 8)), "TQ1_0": ("TQ1_0", (2, 4, 8)), "TQ2_0": ("TQ2_0", (2, 4, 8)),
    "Q6_K": ("Q6_K", (5, 6, 8)), "Q3_K": ("Q3_K_M", (4, 5, 6, 8)), "Q2_K": ("Q2_K", (3, 4, 5, 6, 8)),
}
SIZE_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")


@dataclass
class FormResult:
    qtype: str
    bits: int
    held_bpw: float
    file_bpw: float
    max_rel: float          # max |held - exact| / RMS(exact)
    rms_rel: float          # RMS(held - exact) / RMS(exact)
    top1_llama: float       # fraction of positions whose argmax equals llama.cpp's
    kl_llama: float         # mean KL(llama.cpp || Strata), nats
    dlogit_llama: float     # max |logit difference| vs llama.cpp
    top1_exact: float       # vs Strata holding the exact decode densely
    kl_exact: float


def _weights_error(path: Path, qtype: T, bits: int) -> tuple[float, float]:
    g = open_gguf(path)
    worst, sq, n, ref_sq = 0.0, 0.0, 0, 0.0
    for t in g.reader.tensors:
        if int(t.tensor_type) != qtype or len(t.shape) < 2:
            continue
        exact = quants.decode_exact(t).astype(np.float64)
        m = quants.convert_tensor(t, held_bits=bits)
        held = np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits),
                        np.float64)
        d = held - exact
        worst, sq, n, ref_sq = max(worst, float(np.abs(d).max())), sq + float((d * d).sum()), n + d.size, \
            ref_sq + float((exact * exact).sum())
    ref_rms = (ref_sq / n) ** 0.5
    return worst / ref_rms, (sq / n) ** 0.5 / ref_rms


def _strata_logits(path: Path, ids_list, qtype: T, bits: int | None) -> list[np.ndarray]:
    """Strata's logits with `qtype` held at `bits`, or (None) dense at the exact decode."""
    old = quants.HELD_BITS[qtype]
    dense = quants.convert_tensor
    try:
        if bits is None:
            quants.convert_tensor = _dense_exact(dense, qtype)
        else:
            quants.HELD_BITS[qtype] = bits
        model, _ = load_model(open_gguf(path))
    finally:
        quants.HELD_BITS[qtype], quants.convert_tensor = old, dense
    return [np.array(model(mx.array(ids)[None])[0].astype(mx.float32)) for ids in ids_list]


def _dense_exact(convert, qtype: T):
    def convert_dense(t, dtype=mx.float32, held_bits=None):
        if int(t.tensor_type) != qtype:
            return convert(t, dtype, held_bits)
        return quants.MlxTensor(mx.array(quants.decode_exact(t)).astype(dtype), None, None, None, None, "dense")
    return convert_dense


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def _compare(refs, ours) -> tuple[float, float, float]:
    ref, got = np.concatenate(refs), np.concatenate(ours)
    return (float(np.mean(ref.argmax(-1) == got.argmax(-1))), _kl(ref.astype(np.float64), got.astype(np.float64)),
            float(np.abs(ref - got).max()))


def measure_type(name: str, folder: Path) -> list[FormResult]:
    """`name` on the tiny model quantized "pure" to it, every candidate form."""
    ftype, candidates = TYPES[name]
    return measure_file(quantized_tiny(folder, ftype, pure=True), name, candidates)


def measure_file(path: Path, name: str, candidates) -> list[FormResult]:
    """The tensors of type `name` in the file at `path` held in each candidate form (the file's other
    tensors as Strata holds them), against llama.cpp and against the exact decode."""
    qtype = T[name]
    llm = llama_oracle.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                             n_threads=2)
    ids_list = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]
    refs = [llama_oracle.logits(llm, ids) for ids in ids_list]
    llm.close()
    exact = _strata_logits(path, ids_list, qtype, None)
    block, size = GGML_QUANT_SIZES[qtype]
    out = []
    for bits in candidates:
        ours = _strata_logits(path, ids_list, qtype, bits)
        mx_rel, rms_rel = _weights_error(path, qtype, bits)
        t1, kl, dl = _compare(refs, ours)
        e1, ekl, _ = _compare(exact, ours)
        out.append(FormResult(name, bits, bits + 32 / quants.GROUP_SIZE, size * 8 / block, mx_rel, rms_rel,
                              t1, kl, dl, e1, ekl))
    t1, kl, dl = _compare(refs, exact)
    out.append(FormResult(name, 32, 32.0, size * 8 / block, 0.0, 0.0, t1, kl, dl, 1.0, 0.0))
    return out


def size_ratios(paths: dict[str, Path]) -> list[tuple[str, float, float]]:
    """(label, file bits/weight, held bits/weight) over each file's tensors, float16 compute (the Mac's)."""
    rows = []
    for label, path in paths.items():
        s = memory_estimate.weight_sizes(memory_estimate.read_header(path), "float16")
        rows.append((label, s.file_bpw, s.held_bpw))
    return rows


def q6k_scale_agreement(path: Path) -> tuple[int, float, float]:
    """Over the Q6_K tensors of a file: groups of 32 (two 16-value sub-blocks), the fraction whose two
    int8 sub-block scales are equal (held exactly by 6-bit affine g32), and the median relative
    difference |a - b| / max(|a|, |b|) of the two."""
    rel, equal = [], 0
    for t in open_gguf(path).reader.tensors:
        if int(t.tensor_type) != T.Q6_K:
            continue
        blocks = np.asarray(t.data).reshape(-1, GGML_QUANT_SIZES[T.Q6_K][1])
        sc = blocks[:, 192:208].view(np.int8).astype(np.int32).reshape(-1, 8, 2)   # scale j: values 16j..16j+15
        a, b = sc[..., 0].ravel(), sc[..., 1].ravel()
        equal += int((a == b).sum())
        rel.append(np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1))
    rel = np.concatenate(rel)
    return rel.size, equal / rel.size, float(np.median(rel))


def _record_q6k_scales(run: Run, path: Path, where: str) -> None:
    n, equal, median = q6k_scale_agreement(path)
    run.record(f"Q6_K groups with equal sub-block scales ({where})", equal, "fraction", groups=n,
               median_rel_diff=median, model=where,
               line=f"{where}: Q6_K groups of 32 with equal 16-value scales {equal:.3f} of {n}, "
                    f"median relative difference of the two {median:.2f}")


def _quantized_from(src: Path, folder: Path) -> dict[str, Path]:
    """`src` quantized by llama.cpp (its default mix, no importance matrix) to each of SIZE_FTYPES."""
    out = {}
    for ftype in SIZE_FTYPES:
        dst = folder / f"{src.stem}-{ftype}.gguf"
        if not dst.exists():
            quantize_with_llama(src, dst, ftype)
        out[dst.name] = dst
    return out


def _print_form(run: Run, r: FormResult, where: str) -> None:
    form = "dense" if r.bits == 32 else f"{r.bits}b g32"
    line = (f"{r.qtype:8} {form:>6} {r.held_bpw:5.2f} {r.file_bpw:5.2f} {r.max_rel:8.4f} "
            f"{r.rms_rel:8.4f} {r.top1_llama:8.3f} {r.kl_llama:9.2e} {r.dlogit_llama:8.4f} "
            f"{r.top1_exact:8.3f} {r.kl_exact:9.2e}")
    run.record(f"{r.qtype} {form} KL vs llama.cpp ({where})", r.kl_llama, "nats", line=line,
               held_bpw=r.held_bpw, file_bpw=r.file_bpw, max_rel=r.max_rel, rms_rel=r.rms_rel,
               top1_llama=r.top1_llama, dlogit_llama=r.dlogit_llama, top1_exact=r.top1_exact,
               kl_exact=r.kl_exact, model=where)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="*", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--sizes", action="store_true", help="also held/file ratios of the tiny model per file type")
    ap.add_argument("--file", type=Path, help="also measure a real GGUF file's tensors of --file-type")
    ap.add_argument("--file-type", choices=list(TYPES), default="Q6_K")
    ap.add_argument("--size-files", nargs="*", type=Path, default=[], help="held/file ratios of these files")
    ap.add_argument("--size-from", type=Path, help="quantize this (F16) file with llama.cpp to each of "
                    f"{', '.join(SIZE_FTYPES)} (into --work) and report their held/file ratios")
    ap.add_argument("--work", default=None, help="folder for the tiny models (default: a temporary one)")
    add_args(ap)
    args = ap.parse_args(argv)
    folder = Path(args.work or tempfile.mkdtemp(prefix="strata-quants-"))
    run = Run(out=args.out)
    print(f"{'type':8} {'form':>6} {'held':>5} {'file':>5} {'max/rms':>8} {'rms/rms':>8} "
          f"{'top1 ll':>8} {'KL ll':>9} {'|dl| ll':>8} {'top1 ex':>8} {'KL ex':>9}")
    try:
        for name in args.types:
            for r in measure_type(name, folder):
                _print_form(run, r, "tiny llama")
            if name == "Q6_K":
                _record_q6k_scales(run, quantized_tiny(folder, "Q6_K", pure=True), "tiny llama")
        if args.file:
            print(f"{args.file.name}: its {args.file_type} tensors")
            for r in measure_file(args.file, args.file_type, TYPES[args.file_type][1]):
                _print_form(run, r, args.file.name)
            if args.file_type == "Q6_K":
                _record_q6k_scales(run, args.file, args.file.name)
        files = {f"tiny {ftype}": quantized_tiny(folder, ftype) for ftype in SIZE_FTYPES} if args.sizes else {}
        files.update({p.name: p for p in args.size_files})
        if args.size_from:
            files.update(_quantized_from(args.size_from, folder))
        for label, file_bpw, held_bpw in size_ratios(files):
            run.record(f"{label} held/file", held_bpw / file_bpw, "x", file_bpw=file_bpw, held_bpw=held_bpw,
                       line=f"{label:32} file {file_bpw:.2f} bits/weight, held {held_bpw:.2f} "
                            f"(float16): held/file {held_bpw / file_bpw:.2f}")
    finally:
        llama_oracle.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
