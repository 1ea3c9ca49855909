"""`strata cvec train`: a control vector from paired contrastive prompts, in llama.cpp's format.

    strata cvec train --model M --positive pos.txt --negative neg.txt --out v.gguf [--method mean|pca]

Each file holds one prompt per line; line i of the positive file pairs with line i of the negative
file. Every prompt is rendered with the model's chat template as one user message with the
generation prompt appended, so the last token is where the reply would start. The model runs on
the engine thread (the ``CaptureStates`` request) with every block temporarily wrapped by a capturing module; the hidden
state LEAVING block N at the last token is recorded. That is exactly where llama.cpp adds
``direction.N`` (``build_cvec(cur, il)`` after the FFN residual add, see engine/steer/control_vector.py),
so ``direction.N`` is computed from the output of block N, for N = 1 .. n_layer - 1 (block 0 is
never steered by llama.cpp, so no direction.0 is written).

Methods, per layer N, with ``D`` the (pairs x n_embd) matrix of differences positive - negative:
* ``mean``: ``d = mean(D)`` (its length is the mean separation, so add-mode scales near 1 mean
  "one average difference").
* ``pca``: ``v`` = the first principal component of the differences, as llama.cpp's
  cvector-generator computes it (the top eigenvector of ``D^T D``, i.e. uncentered), its sign set
  so that positives project higher than negatives (``mean(D v) > 0``). The file stores
  ``v * mean(D v)``: the unit direction scaled by the mean separation along it, so its length is
  comparable to the mean method's (project mode only uses the unit direction).

Both methods then make each direction orthogonal to the hidden state of the FIRST position at that
layer (``sink=True``, the default of the command). That position is the model's attention sink: its
state is prompt-independent and carries massive activations (SmolLM2-135M: one dimension reaches
~25,000 from block 11 on, against ~100 elsewhere), and a raw mean difference has a small share of
that dimension. In add mode the share is harmless, but in project mode ``h.v`` at the sink is then
hundreds to thousands, ``h - s (h.v) v`` wrecks the sink, and the model answers garbage (measured:
see bench/README.md). Removing the sink component changes the direction little (its length keeps
>= 95% on SmolLM2) and leaves the sink untouched by a projection. ``sink=False`` (Python API) gives
the plain mean difference / principal component.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import logging

from engine.errors import StrataError
from engine.api import CaptureStates, EngineOptions
from engine.steer.control_vector import write_control_vector
from engine.engine import Engine
from engine.events import Done, Failed, Progress
from engine.model.models import default_model_path


class TrainInputError(StrataError, ValueError):
    """Bad input to `cvec train`: one line, exit 2."""


def read_prompts(path: str, label: str) -> list[str]:
    p = Path(path)
    if not p.exists():
        raise TrainInputError(f"{label} prompt file not found: {path}")
    if not p.is_file():
        raise TrainInputError(f"{label} prompt path is not a file: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TrainInputError(f"{label} prompt file is not UTF-8 text: {path}") from None
    except OSError as e:
        raise TrainInputError(f"{label} prompt file unreadable: {path} ({e.strerror or e})") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise TrainInputError(f"{label} prompt file is empty: {path}")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise TrainInputError(f"{label} prompt file {path}: line {i} is empty (one prompt per line, paired by line)")
    return [line.strip() for line in lines]


def read_pairs(positive: str, negative: str) -> list[tuple[str, str]]:
    pos = read_prompts(positive, "positive")
    neg = read_prompts(negative, "negative")
    if len(pos) != len(neg):
        raise TrainInputError(f"the prompt files pair by line but have {len(pos)} (positive) and "
                              f"{len(neg)} (negative) lines")
    return list(zip(pos, neg))


def directions_from_states(pos: np.ndarray, neg: np.ndarray, method: str = "mean",
                           sink: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """Per-layer directions from (pairs, n_layer, n_embd) states; keys are llama.cpp's N = 1..n_layer-1.

    ``sink`` (n_layer, n_embd): the first position's state; each direction is made orthogonal to it."""
    if pos.shape != neg.shape or pos.ndim != 3:
        raise ValueError(f"states shapes differ: {pos.shape} vs {neg.shape}")
    diff = pos - neg
    n_layer = diff.shape[1]
    out: dict[int, np.ndarray] = {}
    for n in range(1, n_layer):
        D = diff[:, n, :]
        if method == "mean":
            d = D.mean(axis=0)
        elif method == "pca":
            # Top right-singular vector of D (= top eigenvector of D^T D, uncentered, as llama.cpp).
            _, _, vt = np.linalg.svd(D, full_matrices=False)
            v = vt[0]
            sep = float((D @ v).mean())
            if sep < 0:
                v, sep = -v, -sep
            d = v * sep
        else:
            raise ValueError(f"method {method!r} is not 'mean' or 'pca'")
        if sink is not None:
            u = sink[n] / (np.linalg.norm(sink[n]) or 1.0)
            d = d - (d @ u) * u
        out[n] = d.astype(np.float32)
    return out


def train(model: str, pairs: list[tuple[str, str]], method: str = "mean", progress=None,
          sink: bool = True) -> tuple[dict[int, np.ndarray], dict]:
    """Run the pairs through `model`; returns (directions, info). ``sink``: orthogonal to the first
    position's state (see the module docstring)."""
    engine = Engine(EngineOptions(model=model, cache_mib=0)).start()
    try:
        engine.startup.result()                     # the start-up load's own error, if it failed
        prompts = [p for pair in pairs for p in pair]   # pos0, neg0, pos1, neg1, ...
        handle = engine.submit(CaptureStates(prompts))
        for ev in handle.events():
            if isinstance(ev, Progress) and progress and ev.done % 2 == 0:
                progress(ev.done // 2, len(pairs))
            elif isinstance(ev, (Done, Failed)):
                break
        captured = handle.result()
    finally:
        engine.stop()
    states, first = captured.last, np.mean(captured.first, axis=0)
    arch, secs = captured.architecture, captured.seconds
    pos, neg = states[0::2], states[1::2]
    dirs = directions_from_states(pos, neg, method, first if sink else None)
    # Separation report: how well each layer's direction splits the pairs (fraction of pairs
    # whose positive projects higher than its negative).
    sep = {}
    for n, d in dirs.items():
        v = d / (np.linalg.norm(d) or 1.0)
        sep[n] = float(np.mean((pos[:, n] @ v) > (neg[:, n] @ v)))
    return dirs, {"architecture": arch, "seconds": secs, "pair_separation": sep, "states": (pos, neg, first)}


def cmd_train(args) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    pairs = read_pairs(args.positive, args.negative)
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise TrainInputError(f"--out {out} is a folder")
    if not out.parent.exists():
        raise TrainInputError(f"--out folder does not exist: {out.parent}")
    model = args.model or str(default_model_path())
    print(f"cvec train: {len(pairs)} pairs, method {args.method}, model {model}", file=sys.stderr)
    dirs, info = train(model, pairs, args.method,
                       progress=lambda d, t: print(f"pair {d}/{t}", file=sys.stderr, flush=True))
    write_control_vector(out, dirs, model_hint=info["architecture"])
    seps = info["pair_separation"]
    if args.verbose:
        for n in sorted(dirs):
            print(f"direction.{n}: |d| {np.linalg.norm(dirs[n]):.3f}, pairs separated {seps[n]:.0%}", file=sys.stderr)
    print(f"wrote {out}: direction.1..{max(dirs)} ({len(dirs)} layers, width {len(next(iter(dirs.values())))}), "
          f"{info['seconds']:.1f} s", file=sys.stderr)
    return 0
