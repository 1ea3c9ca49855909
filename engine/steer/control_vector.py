"""Control vectors ("the speed projection"): llama.cpp's control-vector GGUF files, loaded for the MLX engine.

A control-vector file is a GGUF whose tensors are named ``direction.N`` (N >= 1), each a 1-D F32
tensor of the model's width; ``general.architecture = "controlvector"``,
``controlvector.model_hint`` and ``controlvector.layer_count`` are written by llama.cpp's
cvector-generator but are optional (llama.cpp's loader reads no metadata key at all).

Layer numbering, exactly as llama.cpp does it (ggml-org/llama.cpp, read through the search tool):

* ``common/common.cpp``, ``common_control_vector_load_one``: ``direction.N`` is parsed with
  ``std::stoi``; N < 0 or unparsable -> "invalid/unparsable direction tensor layer index",
  N == 0 -> "invalid (zero) direction tensor layer index"; non-F32 -> refused; non-1-D -> refused;
  a width differing from the file's first tensor -> refused. The data lands in a flat buffer at
  ``n_embd * (N - 1)`` ("layer 1 at [0]"), multiplied by the file's strength
  (``dst[j] += src[j] * load_info.strength``).
* ``common_control_vector_load``: several files are SUMMED element-wise, each already multiplied
  by its own scale; a width mismatch between files is refused.
* ``src/llama-adapter.cpp``, ``llama_adapter_cvec::apply``: for ``il = 1 .. n_layer - 1`` the
  per-layer tensor ``tensors[il]`` is filled from offset ``n_embd * (il - 1)``; ``tensors[0]`` is
  always null ("there's never a tensor for layer 0"). The two "- 1"s cancel: **direction.N belongs
  to block il = N** (0-based block index, as in ``model.model.layers[N]``). Block 0 can never be
  steered, and a ``direction.N`` with N >= n_layer is silently unused.
* ``llama_adapter_cvec::tensor_for(il)`` returns null when ``il < layer_start || il > layer_end``:
  the ``--control-vector-layer-range START END`` bounds are **inclusive on both ends** (common/arg.cpp
  documents it: "layer range to apply the control vector(s) to, start and end inclusive").
  ``common_init_from_params`` replaces ``start <= 0`` by 1 and ``end <= 0`` by ``n_layer``.
* The apply site: every model graph (src/models/llama.cpp, qwen2.cpp, qwen3.cpp, ...) does
  ``cur = ggml_add(ctx0, cur, ffn_inp); cur = build_cvec(cur, il); cb(cur, "l_out", il);`` i.e. the
  direction is added to the residual stream LEAVING block il (after the FFN residual add), which
  is the output of ``model.model.layers[il]`` in mlx-lm; the next block reads the steered value.

So here: ``direction.N`` steers the output of ``model.model.layers[N]`` for N in the inclusive
range, block 0 never. Add mode is llama.cpp's operation (``h + sum_i s_i * d_i``); project mode
is Strata's (``h - s (h.v) v``), applied at the same site.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import StrataError
import gguf
import mlx.core as mx
from engine.steer.steering import fused_steerer, steerer
from engine.errors import ModelFileError
from engine.model.gguf_header import scan_header

MODES = ("add", "project")
_DIRECTION_RE = re.compile(r"^direction\.(-?\d+)$")
_SINGLE_RE = re.compile(r"^single:(-?\d+)$")


class ControlVectorError(StrataError, ValueError):
    """A control-vector file or setting that is refused; the message is one line."""


@dataclass(frozen=True)
class SteeringConfig:
    files: tuple[tuple[str, float], ...] = ()      # (path, scale); --control-vector FILE is scale 1.0
    layer_range: tuple[int, int] | None = None     # llama.cpp's numbering, inclusive
    mode: str = "add"                              # "add" | "project"
    direction: str = "per-layer"                   # "per-layer" | "single:L"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ControlVectorError(f"control vector mode {self.mode!r} is not one of: add, project")
        if self.direction != "per-layer" and not _SINGLE_RE.match(self.direction):
            raise ControlVectorError(
                f"control vector dir {self.direction!r} is not 'per-layer' or 'single:L' (L a layer number)"
            )
        if self.direction != "per-layer" and self.single_layer() < 1:
            raise ControlVectorError(f"control vector dir {self.direction!r}: L must be >= 1 (llama.cpp has no direction.0)")

    def single_layer(self) -> int | None:
        m = _SINGLE_RE.match(self.direction)
        return int(m.group(1)) if m else None

    @staticmethod
    def parse_scaled(arg: str) -> tuple[str, float]:
        """``FILE:SCALE`` (as ``--control-vector-scaled``); the last colon splits, so ``C:\\x.gguf:0.5`` works."""
        path, sep, scale = arg.rpartition(":")
        if not sep or not path:
            raise ControlVectorError(f"control vector argument {arg!r} is not FILE:SCALE")
        try:
            value = float(scale)
        except ValueError:
            raise ControlVectorError(f"control vector argument {arg!r}: scale {scale!r} is not a number") from None
        if not math.isfinite(value):
            raise ControlVectorError(f"control vector argument {arg!r}: scale must be finite")
        return path, value


def _read_file(path: str, n_embd: int) -> tuple[dict[int, np.ndarray], str]:
    """One file -> ({N: float32 direction}, model_hint). Refusals follow llama.cpp's loader."""
    if not os.path.exists(path):
        raise ControlVectorError(f"control vector file not found: {path}")
    if not os.path.isfile(path):
        raise ControlVectorError(f"control vector path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ControlVectorError(f"control vector file unreadable: {path} ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise ControlVectorError(f"control vector file is not a GGUF file: {path}")

    try:
        scan_header(Path(path))      # counts and lengths checked before gguf-py allocates for them
    except ModelFileError as e:
        raise ControlVectorError(f"control vector file is not a readable GGUF: {e}") from None
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated or corrupt container
        raise ControlVectorError(f"control vector file is not a readable GGUF: {path} ({e})") from None

    hint = ""
    field = reader.fields.get("controlvector.model_hint")
    if field is not None:
        try:
            hint = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        except Exception:
            hint = ""

    out: dict[int, np.ndarray] = {}
    if not reader.tensors:
        raise ControlVectorError(f"control vector file has no direction tensors: {path}")
    for t in reader.tensors:
        m = _DIRECTION_RE.match(t.name)
        if not m:
            raise ControlVectorError(f"control vector file {path}: tensor {t.name!r} is not named direction.N")
        n = int(m.group(1))
        if n <= 0:
            raise ControlVectorError(
                f"control vector file {path}: {t.name} is invalid (llama.cpp numbers directions from 1; block 0 is never steered)"
            )
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ControlVectorError(
                f"control vector file {path}: {t.name} is {t.tensor_type.name}, only F32 direction tensors are accepted"
            )
        dims = [int(d) for d in t.shape]
        if len(dims) != 1:
            raise ControlVectorError(f"control vector file {path}: {t.name} is not 1-D (shape {dims})")
        if dims[0] != n_embd:
            raise ControlVectorError(
                f"control vector file {path}: {t.name} has width {dims[0]}, expected {n_embd} (the model's n_embd)"
            )
        data = np.asarray(t.data, dtype=np.float32).reshape(-1).copy()
        if not np.all(np.isfinite(data)):
            raise ControlVectorError(f"control vector file {path}: {t.name} contains NaN or Inf")
        # llama.cpp: "allows multiple directions for same layer in same file" (they add up)
        out[n] = out[n] + data if n in out else data
    return out, hint


class ControlVector:
    """The loaded, combined vector for one model.

    ``directions[il]`` (mx.array float32, shape (n_embd,)) for each steered block il only:
    add mode: ``sum_i s_i d_i`` (scales already folded in, ``scale`` = 1.0);
    project mode: the unit direction v, with ``scale`` = s.
    """

    def __init__(self, *, mode: str, direction: str, lo: int, hi: int, n_layer: int, n_embd: int,
                 directions: dict[int, np.ndarray], scale: float, files: tuple[tuple[str, float], ...],
                 model_hints: tuple[str, ...]):

        self.mode = mode
        self.direction = direction
        self.lo, self.hi = lo, hi
        self.n_layer, self.n_embd = n_layer, n_embd
        self.scale = float(scale)
        self.files = files
        self.model_hints = model_hints
        self._np = {il: np.ascontiguousarray(v, dtype=np.float32) for il, v in sorted(directions.items())}
        self.directions = {il: mx.array(v) for il, v in self._np.items()}
        self._steerers: dict = {}
        self._fused: dict = {}
        self._fingerprint = self._compute_fingerprint()

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, config: SteeringConfig, n_layer: int, n_embd: int) -> "ControlVector":
        if not config.files:
            raise ControlVectorError("no control vector file given")
        if n_layer < 2:
            raise ControlVectorError(f"the model has {n_layer} layer(s); llama.cpp never steers block 0, nothing to steer")

        # Range: llama.cpp's defaults (<= 0 means "unset": start -> 1, end -> n_layer), inclusive.
        # Negative bounds or bounds past n_layer are refused instead of silently clipped.
        start, end = config.layer_range if config.layer_range is not None else (0, 0)
        if start < 0 or end < 0 or start > n_layer or end > n_layer:
            raise ControlVectorError(
                f"control vector layer range {start}..{end} is outside the model "
                f"({n_layer} layers; blocks 1..{n_layer - 1} can be steered)"
            )
        start = 1 if start <= 0 else start
        end = n_layer if end <= 0 else end
        if start > end:
            raise ControlVectorError(f"control vector layer range {start}..{end} is empty (start > end)")
        lo, hi = start, min(end, n_layer - 1)  # llama.cpp only has tensors for il < n_layer
        if lo > hi:
            raise ControlVectorError(
                f"control vector layer range {start}..{end} is outside the model "
                f"({n_layer} layers; blocks 1..{n_layer - 1} can be steered)"
            )

        # Sum the files, each multiplied by its scale (common_control_vector_load).
        combined: dict[int, np.ndarray] = {}
        hints: list[str] = []
        for path, scale in config.files:
            dirs, hint = _read_file(str(path), n_embd)
            hints.append(hint)
            for n, d in dirs.items():
                sd = d.astype(np.float64) * float(scale)
                combined[n] = combined[n] + sd if n in combined else sd

        single = config.single_layer()
        if single is not None:
            if single not in combined:
                have = ", ".join(str(n) for n in sorted(combined)) or "none"
                raise ControlVectorError(
                    f"control vector dir single:{single}: no direction.{single} in the file(s) (directions present: {have})"
                )
            src = {il: combined[single] for il in range(lo, hi + 1)}
        else:
            # A block with no direction.N in any file gets llama.cpp's zero tensor: a no-op,
            # so it is simply not steered here (and costs nothing).
            src = {il: combined[il] for il in range(lo, hi + 1) if il in combined}

        if config.mode == "add":
            directions = {il: d.astype(np.float32) for il, d in src.items()}
            scale = 1.0
        else:
            # Project with several files (Strata's choice): v = normalise(sum_i s_i d_i), i.e. the
            # scales weight the files' directions in the mix, and the projection strength s is the
            # mean of the file scales (for one file: v = d/|d|, s = its scale; s = 1 removes the
            # component, s = 2 reflects it). A block whose summed direction is zero is not steered.
            directions = {}
            for il, d in src.items():
                norm = float(np.linalg.norm(d))
                if norm > 0.0 and math.isfinite(norm):
                    directions[il] = (d / norm).astype(np.float32)
            scale = sum(s for _, s in config.files) / len(config.files)

        return cls(mode=config.mode, direction=config.direction, lo=lo, hi=hi, n_layer=n_layer, n_embd=n_embd,
                   directions=directions, scale=scale,
                   files=tuple((str(p), float(s)) for p, s in config.files), model_hints=tuple(hints))

    # -- queries -----------------------------------------------------------------------------
    def steered_layers(self) -> list[int]:
        return list(self._np)

    def describe(self) -> str:
        return (f"control vector mode = {self.mode}, dir = {self.direction}, "
                f"layers {self.lo}..{self.hi} ({len(self._np)} steered)")

    def fingerprint(self) -> str:
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(b"strata-cvec-v1\0")
        h.update(f"mode={self.mode};dir={self.direction};range={self.lo}..{self.hi};".encode())
        h.update(f"n_layer={self.n_layer};n_embd={self.n_embd};".encode())
        h.update(struct.pack("<d", self.scale))
        for _, s in self.files:  # file order does not change the sum, but the scales are named
            h.update(struct.pack("<d", s))
        for il, v in self._np.items():
            h.update(struct.pack("<i", il))
            h.update(v.tobytes())
        return h.hexdigest()[:32]

    # -- the operation -----------------------------------------------------------------------
    def steers(self, layer: int) -> bool:
        return layer in self.directions

    def apply_residual(self, h, res, layer: int):
        """apply(h + res, layer), fused into one kernel on a GPU (the block's last residual add)."""
        fn = self._fused.get(layer)
        if fn is None:
            vec = self.directions.get(layer)
            if vec is None:
                return h + res
            fn = self._fused[layer] = fused_steerer(vec, self.scale, self.mode)
        return fn(h, res)

    def apply(self, h, layer: int):
        fn = self._steerers.get(layer)
        if fn is None:
            vec = self.directions.get(layer)
            if vec is None:
                return h
            # Made on first use, kept: the per-step call then costs only the kernel call.
            fn = self._steerers[layer] = steerer(vec, self.scale, self.mode)
        return fn(h)


def write_control_vector(path, directions: dict[int, np.ndarray], model_hint: str = "") -> None:
    """Write llama.cpp's control-vector GGUF, as cvector-generator's ``export_gguf`` does:
    ``general.architecture = "controlvector"``, ``controlvector.model_hint`` (string),
    ``controlvector.layer_count`` (int32, the number of direction tensors), tensors
    ``direction.N`` (F32, 1-D) in ascending N."""
    if not directions:
        raise ControlVectorError("no directions to write")
    width = None
    arrays: list[tuple[int, np.ndarray]] = []
    for n in sorted(directions):
        if int(n) < 1:
            raise ControlVectorError(f"direction.{n} cannot be written: llama.cpp numbers directions from 1")
        a = np.ascontiguousarray(np.asarray(directions[n], dtype=np.float32).reshape(-1))
        if width is None:
            width = a.shape[0]
        elif a.shape[0] != width:
            raise ControlVectorError(f"direction.{n} has width {a.shape[0]}, expected {width}")
        arrays.append((int(n), a))
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch="controlvector")
    w.add_string("controlvector.model_hint", model_hint)
    w.add_int32("controlvector.layer_count", len(arrays))
    for n, a in arrays:
        w.add_tensor(f"direction.{n}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
