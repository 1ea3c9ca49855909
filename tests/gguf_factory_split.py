"""Split GGUF sets for tests, written the way llama.cpp's gguf-split writes them.

``write_split(src, folder, n_parts)`` reads a GGUF with gguf-py's GGUFReader and writes
``<stem>-00001-of-0000N.gguf`` ... : the first part holds every metadata key, each part the split keys
(``split.no`` uint16, ``split.count`` uint16, ``split.tensors.count`` int32) and its share of the tensors,
byte for byte as they were. ``keys`` changes or drops a part's split keys (hostile sets).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from gguf_factory import write_tiny_gguf

SPLIT_TYPES = {"split.no": GGUFValueType.UINT16, "split.count": GGUFValueType.UINT16,
               "split.tensors.count": GGUFValueType.INT32}
DROP = object()        # a `keys` value: leave the key out of that part


def part_name(stem: str, no: int, count: int) -> str:
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def write_split(src, folder, n_parts: int, *, stem: str | None = None,
                keys: dict[int, dict] | None = None, first_without_tensors: bool = False,
                shares: list[list[int]] | None = None) -> list[Path]:
    """`src` written as a set of `n_parts` files in `folder`; their paths, first part first. `keys` maps a
    0-based part index to split keys to write instead (or DROP), or to other keys as (value, GGUFValueType).
    `first_without_tensors`: the first part holds metadata only (gguf-split --no-tensor-first-split).
    `shares`: which tensors (indices into the source's) each part holds, instead of an even split."""
    r = GGUFReader(str(src), "r")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = stem or Path(src).stem
    tensors = list(r.tensors)
    if shares is None:
        shares = [list(a) for a in np.array_split(np.arange(len(tensors)),
                                                  n_parts - 1 if first_without_tensors else n_parts)]
        if first_without_tensors:
            shares = [[]] + shares
    paths = []
    for i, share in enumerate(shares):
        path = folder / part_name(stem, i + 1, n_parts)
        split = {"split.no": i, "split.count": n_parts, "split.tensors.count": len(tensors)}
        split.update((keys or {}).get(i, {}))
        _write_part(path, r, [tensors[j] for j in share], split, with_metadata=i == 0)
        paths.append(path)
    return paths


def _write_part(path: Path, r: GGUFReader, tensors: list, split: dict, with_metadata: bool) -> None:
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(path), arch)
    if with_metadata:
        for key, field in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = GGUFValueType(field.types[0])
            sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub)
    else:
        del w.kv_data[0]["general.architecture"]     # the other parts carry the split keys only
    for key, value in split.items():
        if value is DROP:
            continue
        if key in SPLIT_TYPES:
            w.add_key_value(key, value, SPLIT_TYPES[key])
        else:
            w.add_key_value(key, value[0], value[1])
    for t in tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=GGMLQuantizationType(int(t.tensor_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hostile_sets(src, folder) -> dict[str, tuple[Path, str]]:
    """Three broken sets of `src` (a tiny model of width 64, as gguf_factory writes by default) under
    `folder`: a part missing, parts of two models (the last part of a narrower model), counts that
    disagree (the last part says the set has 4). Each: (its first part, the name of the part a refusal
    must name)."""
    folder = Path(folder)
    missing = write_split(src, folder / "missing", 3, stem="Missing")
    missing[1].unlink()
    narrow = write_split(write_tiny_gguf(folder / "narrow.gguf", arch="llama", n_embd=32, n_head=4, n_head_kv=2,
                                         n_ff=64, seed=3), folder / "narrow", 3, stem="Mixed")
    mixed = write_split(src, folder / "mixed", 3, stem="Mixed")
    mixed[2].write_bytes(narrow[2].read_bytes())
    counts = write_split(src, folder / "counts", 3, stem="Counts", keys={2: {"split.count": 4}})
    return {"missing": (missing[0], missing[1].name), "two-models": (mixed[0], mixed[2].name),
            "counts": (counts[0], counts[2].name)}
