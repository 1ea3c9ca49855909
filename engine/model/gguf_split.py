"""Split GGUF models: a `<prefix>-00001-of-0000N.gguf` set (llama.cpp's gguf-split, gguf-py's GGUFWriter
with a split limit) read as one model. Plain Python: no numpy, no mlx, so the app's model list uses it.

How llama.cpp writes a set: every part carries `split.no` (0-based, uint16), `split.count` (uint16) and
`split.tensors.count` (int32, the tensors of the whole set); the first part holds every other metadata
key too, the others only the split keys; each part's tensors are its own, in its own data section.
The name is `%s-%05d-of-%05d.gguf` with the 1-based part number.

What is checked before a part is trusted, each failure one line naming the part:

- the file opened is the set's first part, named as llama.cpp names it;
- every part named by the count is there (a missing one is named);
- each part says it is that part (`split.no`) of a set of that size (`split.count`) with that many tensors
  (`split.tensors.count`): a part of another model's set says otherwise;
- a metadata key a part shares with the first part has the same value there;
- no tensor is in two parts, and the parts hold exactly `split.tensors.count` tensors;
- a part's block norms are as wide as the first part's model (`<arch>.embedding_length`) and its blocks
  are within `<arch>.block_count`: a part of a same-sized set of another width, or of a deeper model,
  is named here rather than failing as a shape mismatch later.

Two sets of the same architecture, size and tensor count but other weights cannot be told apart from
their headers alone (llama.cpp cannot either); the whole set's content hash (gguf_file.set_hash) keeps
their sessions and cached K/V apart.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

from engine.errors import ModelFileError

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
MAX_PARTS = 99_999                 # five digits in the name
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_BLOCK = re.compile(r"^blk\.(\d+)\.")


class _Tensor(Protocol):
    name: str
    shape: tuple[int, ...]


class PartHeader(Protocol):
    """What the checks read of one part: engine/memory_estimate.GGUFHeader has it."""
    path: Path
    metadata: dict
    tensors: Sequence[_Tensor]


@dataclass(frozen=True)
class SplitName:
    """`prefix-NNNNN-of-MMMMM.gguf`: part `no` (1-based) of `count`."""
    folder: Path
    prefix: str
    no: int
    count: int

    def part(self, no: int) -> Path:
        return self.folder / f"{self.prefix}-{no:05d}-of-{self.count:05d}.gguf"

    @property
    def first(self) -> Path:
        return self.part(1)

    def paths(self) -> list[Path]:
        return [self.part(i) for i in range(1, self.count + 1)]


def split_name(path: str | os.PathLike) -> SplitName | None:
    """The set `path`'s name says it belongs to, or None when it is not named as a part."""
    p = Path(path)
    m = _NAME.match(p.name)
    if m is None:
        return None
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        return None
    return SplitName(p.parent, m["prefix"], no, count)


def _count(h: PartHeader, key: str) -> int | None:
    v = h.metadata.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelFileError(f"{h.path.name}: '{key}' must be an integer, the file has {v!r:.40}")
    return v


def set_label(path: str | os.PathLike) -> str:
    """A model's name for people: a split set's name and part count, else the file's name."""
    sn = split_name(path)
    return f"{sn.prefix} ({sn.count} parts)" if sn is not None else Path(path).name


def is_split(h: PartHeader) -> bool:
    """Whether header `h` is a part of a set of more than one file (its `split.count` says so)."""
    n = _count(h, SPLIT_COUNT)
    return n is not None and n > 1


def set_of(first: PartHeader) -> SplitName:
    """The set the file of header `first` opens: it must be the first part, named as llama.cpp names it."""
    name = first.path.name
    count, no = _count(first, SPLIT_COUNT), _count(first, SPLIT_NO)
    if count is None or not 1 < count <= MAX_PARTS:
        raise ModelFileError(f"{name}: split.count {count} is not a part count (2 to {MAX_PARTS})")
    sn = split_name(first.path)
    if no is not None and no != 0:
        first_name = sn.first.name if sn is not None else "the set's first part"
        raise ModelFileError(f"{name} is part {no + 1} of {count} of a split model: load its first part, "
                             f"{first_name}")
    if sn is None or sn.count != count or sn.no != 1:
        raise ModelFileError(f"{name}: a split model's first part of {count} must be named "
                             f"<name>-00001-of-{count:05d}.gguf")
    return sn


def read_parts(first: PartHeader, read: Callable[[Path], PartHeader]) -> list[PartHeader]:
    """Every part of the set whose first part's header is `first`, each read with `read` (a path's header;
    its own errors name its file) and checked against the first; ModelFileError naming the part that
    does not belong."""
    sn = set_of(first)
    total = _count(first, SPLIT_TENSORS)
    if total is None or total < 0:
        raise ModelFileError(f"{first.path.name}: a split model's first part needs '{SPLIT_TENSORS}'")
    parts = [first]
    for no in range(2, sn.count + 1):
        p = sn.part(no)
        if not os.path.lexists(p):
            raise ModelFileError(f"{first.path.name}: part {no} of {sn.count} of this split model is missing "
                                 f"({p.name} is not in {p.parent})")
        h = read(p)
        check_part(first, h, no - 1, sn.count, total)
        parts.append(h)
    check_tensors(parts, total)
    return parts


def check_part(first: PartHeader, h: PartHeader, index: int, count: int, total: int) -> None:
    """Part `h` says it is part `index` (0-based) of `count` parts holding `total` tensors, and agrees
    with the first part on every metadata key they share."""
    name = h.path.name
    no, n, t = _count(h, SPLIT_NO), _count(h, SPLIT_COUNT), _count(h, SPLIT_TENSORS)
    if no is None or n is None or t is None:
        raise ModelFileError(f"{name}: not a part of a split model (no split.no / split.count / "
                             f"split.tensors.count)")
    if n != count:
        raise ModelFileError(f"{name}: split.count is {n}, the first part {first.path.name} says {count}: "
                             f"parts of two split models")
    if no != index:
        raise ModelFileError(f"{name}: split.no says part {no + 1}, its name says part {index + 1} of {count}")
    if t != total:
        raise ModelFileError(f"{name}: split.tensors.count is {t}, the first part {first.path.name} says "
                             f"{total}: parts of two split models")
    for key, value in h.metadata.items():
        if key not in SPLIT_KEYS and key in first.metadata and first.metadata[key] != value:
            raise ModelFileError(f"{name}: metadata '{key[:80]}' differs from the first part's "
                                 f"({first.path.name}): parts of two models")


def check_tensors(parts: list[PartHeader], total: int) -> None:
    """No tensor in two parts, `total` tensors in all, each part's blocks within the first part's model."""
    where: dict[str, str] = {}
    meta = parts[0].metadata
    arch = str(meta.get("general.architecture", ""))
    width, n_layer = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.block_count")
    for h in parts:
        for t in h.tensors:
            if t.name in where:
                other = where[t.name]
                raise ModelFileError(f"{h.path.name}: tensor '{t.name[:80]}' is also in {other}"
                                     if other != h.path.name else
                                     f"{h.path.name}: tensor '{t.name[:80]}' appears twice")
            where[t.name] = h.path.name
            _check_block(h.path.name, t, width, n_layer)
    if len(where) != total:
        raise ModelFileError(f"{parts[0].path.name}: the split model's {len(parts)} parts hold {len(where)} "
                             f"tensors, its split.tensors.count says {total}")


def _check_block(part: str, t: _Tensor, width, n_layer) -> None:
    m = _BLOCK.match(t.name)
    if m is not None and isinstance(n_layer, int) and int(m.group(1)) >= n_layer:
        raise ModelFileError(f"{part}: tensor '{t.name[:80]}' is of block {m.group(1)}, the model has "
                             f"{n_layer} blocks: parts of two models")
    if isinstance(width, int) and (t.name.endswith(".attn_norm.weight") or t.name == "output_norm.weight") \
            and math.prod(t.shape) != width:
        raise ModelFileError(f"{part}: tensor '{t.name[:80]}' is {math.prod(t.shape)} wide, the model's "
                             f"width is {width}: parts of two models")


def group_parts(paths: Iterable[Path]) -> list[Path]:
    """`paths` with the parts of each split set after the first dropped when that first part is among
    them: a set is one model, opened by its first part. A part whose first part is absent stays (its
    row says the first part is missing when read)."""
    paths = list(paths)
    names = {Path(p).name.lower() for p in paths}
    out = []
    for p in paths:
        sn = split_name(p)
        if sn is not None and sn.no > 1 and sn.first.name.lower() in names:
            continue
        out.append(p)
    return out
