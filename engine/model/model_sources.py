"""Where Strata finds GGUF models: its own models folder, the folders the user adds, and the libraries
other apps already keep on this Mac, read where they are (never copied, moved or written):

- LM Studio's models folder, `~/.lmstudio/models` (older versions: `~/.cache/lm-studio/models`), laid
  out as `<publisher>/<repository>/<file>.gguf`;
- the Hugging Face hub cache, `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`:
  `models--<org>--<name>/snapshots/<revision>/**/*.gguf`, each a symlink into `blobs/`;
- Ollama's store, `$OLLAMA_MODELS`, else `~/.ollama/models`: `manifests/<registry>/<namespace>/<model>/<tag>`
  is JSON whose layer of media type `application/vnd.ollama.image.model` names the blob
  (`blobs/sha256-<hex>`) holding the GGUF (a `...image.projector` layer: its vision projector).

In each folder a split set (`<name>-00001-of-0000N.gguf`, engine/model/gguf_split.py) is one model, opened by
its first part; `mmproj-*` (vision projector) and `mtp-*` (MTP drafter) files are paired with their
model, not listed as models. The same file reached twice (a link, two snapshots of one blob, a library
inside a user folder) is listed once, first where it was first found.

A folder that is missing, unreadable, in a symlink loop, or slow is never waited on for long: each
root is walked within a depth, an entry count and a time bound (its own thread, joined with a
timeout, so a hung network mount leaves a note instead of holding the caller), and what could not be
read is a one-line note. Plain Python: the app's model list and `strata models list` both use it.

STRATA_LIBRARY_HOME replaces the home folder the libraries are looked for in (the tests point it at a
generated tree); STRATA_LIBRARIES=off looks in none of them.
"""
from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from engine.errors import ModelFileError
from engine.model.gguf_header import open_regular
from engine.model.gguf_split import split_name

FLAT, TREE, HF, OLLAMA = "flat", "tree", "hf", "ollama"     # how a root is laid out
STRATA, FOLDER, LM_STUDIO, HUGGING_FACE, OLLAMA_LABEL = "Strata", "Folder", "LM Studio", "Hugging Face", "Ollama"
MAX_FILES = 2000              # models listed per root
MAX_ENTRIES = 50_000          # directory entries looked at per root
MAX_DEPTH = 6                 # folders below a root (Ollama's manifests are 4 deep, LM Studio's files 2)
ROOT_SECONDS = 5.0            # per root: past this its walk is left, with a note
MANIFEST_BYTES = 1 << 20      # an Ollama manifest is a few hundred bytes
MODEL_MEDIA = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA = "application/vnd.ollama.image.projector"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class Root:
    path: Path
    source: str                 # the label each model found there carries
    layout: str = FLAT


@dataclass(frozen=True)
class FoundModel:
    path: Path                  # the file to load: a split set's first part, an Ollama blob
    source: str                 # where it lives: Strata, Folder, LM Studio, Hugging Face, Ollama
    label: str = ""             # the library's own name for it (Ollama's model:tag, a Hub repository)
    parts: int = 1              # files in its split set
    mmproj: Path | None = None  # its vision projector, found beside it
    mtp: Path | None = None     # its MTP drafter, found beside it

    def where(self) -> str:
        """One line saying where it lives, for a list row."""
        extra = f" ({self.label})" if self.label else ""
        return f"{self.source}{extra}: {self.path}"


@dataclass
class Scan:
    models: list[FoundModel] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # one line per root not (wholly) read


def library_roots(env: Mapping[str, str] | None = None, home: Path | None = None) -> list[Root]:
    """The other apps' libraries, from the environment (`env`, default os.environ) and the home folder."""
    env = os.environ if env is None else env
    if env.get("STRATA_LIBRARIES", "").lower() in ("0", "off", "no", "false"):
        return []
    base = Path(env.get("STRATA_LIBRARY_HOME") or home or Path.home()).expanduser()
    if env.get("HF_HUB_CACHE"):
        hf = Path(env["HF_HUB_CACHE"])
    elif env.get("HF_HOME"):
        hf = Path(env["HF_HOME"]) / "hub"
    elif env.get("XDG_CACHE_HOME") and not env.get("STRATA_LIBRARY_HOME"):
        hf = Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    else:
        hf = base / ".cache" / "huggingface" / "hub"
    ollama = Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else base / ".ollama" / "models"
    return [Root(base / ".lmstudio" / "models", LM_STUDIO, TREE),
            Root(base / ".cache" / "lm-studio" / "models", LM_STUDIO, TREE),
            Root(hf.expanduser(), HUGGING_FACE, HF), Root(ollama.expanduser(), OLLAMA_LABEL, OLLAMA)]


def folder_roots(models_dir: Path, folders: list[str] | tuple = ()) -> list[Root]:
    """Strata's models folder (its `*.gguf` entries) and the user's folders (walked as a library is,
    so a folder laid out as LM Studio's, `<publisher>/<repository>/<file>.gguf`, can be added whole)."""
    return [Root(Path(models_dir), STRATA), *(Root(Path(f).expanduser(), FOLDER, TREE) for f in folders)]


def find(roots: list[Root], seconds: float = ROOT_SECONDS) -> Scan:
    """Every model under `roots`, each file once, in the roots' order; notes for what was not read.
    The roots are walked at once, each on its own thread, all within one bound: slow or hung roots
    cost `seconds` (and a second's grace) together, not each."""
    walks = [_Walk(root, seconds) for root in roots]
    deadline = time.monotonic() + seconds + 1.0
    scan, seen = Scan(), set()
    for w in walks:
        found, notes = w.result(max(0.0, deadline - time.monotonic()))
        scan.notes += notes
        for m in found:
            key = _identity(m.path)
            if key not in seen:
                seen.add(key)
                scan.models.append(m)
    return scan


class _Walk:
    """`root` walked on a thread of its own (a blocking system call on a dead mount cannot be
    interrupted: a walk not done in time is left behind, its results dropped)."""

    def __init__(self, root: Root, seconds: float):
        self.root, self.seconds, self.out = root, seconds, None
        self.thread = threading.Thread(target=self._run, name="strata-library-scan", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        root = self.root
        try:
            self.out = _walk_root(root, time.monotonic() + self.seconds)
        except Exception as e:  # noqa: BLE001 -- one root's surprise is its note, the others are read
            self.out = ([], [f"{root.source} {root.path}: not read ({type(e).__name__}: {str(e)[:120]})"])

    def result(self, wait: float) -> tuple[list[FoundModel], list[str]]:
        self.thread.join(wait)
        out = self.out
        if out is None:
            return [], [f"{self.root.source} {self.root.path}: not read: it takes longer than {self.seconds:g} s"]
        return out


def _identity(p: Path):
    """The file `p` reaches: (device, inode) when it can be read, else its resolved or given path."""
    try:
        st = os.stat(p)
        return (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        try:
            return str(p.resolve())
        except (OSError, RuntimeError):
            return str(p)


class _Budget:
    def __init__(self, deadline: float):
        self.deadline, self.entries, self.notes = deadline, 0, []

    def spend(self, root: Root) -> bool:
        """One entry looked at; False once the root's entry count or time is spent (noted once)."""
        self.entries += 1
        if self.entries > MAX_ENTRIES or time.monotonic() > self.deadline:
            if not self.notes:
                why = f"more than {MAX_ENTRIES} entries" if self.entries > MAX_ENTRIES else "too slow to read"
                self.notes.append(f"{root.source} {root.path}: only partly read ({why})")
            return False
        return True


def _walk_root(root: Root, deadline: float) -> tuple[list[FoundModel], list[str]]:
    b = _Budget(deadline)
    if not _is_dir(root.path):
        return [], []               # a library that is not installed: nothing to say
    if root.layout == OLLAMA:
        return _ollama(root, b), b.notes
    if root.layout == FLAT:
        files = {root.path: _list_gguf(root.path, root, b, regular_only=False)}
    elif root.layout == HF:
        files = {}
        for repo in _subdirs(root.path, root, b, prefix="models--"):
            for snap in _subdirs(repo / "snapshots", root, b):
                _tree(snap, root, b, 3, files, set())
    else:
        files = {}
        _tree(root.path, root, b, MAX_DEPTH, files, set())
    out = []
    for folder, names in files.items():
        label = _hf_label(folder, root) if root.layout == HF else ""
        out += group_folder(names, root.source, label)
    return out[:MAX_FILES], b.notes


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except (OSError, RuntimeError):
        return False


def _entries(d: Path, root: Root, b: _Budget) -> list[os.DirEntry]:
    """`d`'s entries, sorted by name; none (with a note) when it cannot be listed."""
    try:
        with os.scandir(d) as it:
            out = []
            for e in it:
                if not b.spend(root):
                    break
                out.append(e)
    except OSError as e:
        b.notes.append(f"{root.source}: cannot read {d}: {e.strerror or e}")
        return []
    return sorted(out, key=lambda e: e.name)


def _subdirs(d: Path, root: Root, b: _Budget, prefix: str = "") -> list[Path]:
    if not _is_dir(d):
        return []
    return [Path(e.path) for e in _entries(d, root, b)
            if e.name.startswith(prefix) and not e.name.startswith(".") and _entry_is_dir(e)]


def _entry_is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()              # follows a link: a linked folder is walked (loops are stopped)
    except OSError:
        return False


def _list_gguf(d: Path, root: Root, b: _Budget, regular_only: bool) -> list[Path]:
    """`d`'s `*.gguf` entries. `regular_only`: only those that reach a regular file (a library's dangling
    link, an unfinished download, is not a model); else every one (its row says why it cannot load)."""
    out = []
    for e in _entries(d, root, b):
        if not e.name.lower().endswith(".gguf") or e.name.startswith("."):
            continue
        if regular_only:
            try:
                if not stat.S_ISREG(os.stat(e.path).st_mode):
                    continue
            except (OSError, ValueError):
                continue
        out.append(Path(e.path))
    return out


def _tree(d: Path, root: Root, b: _Budget, depth: int, files: dict, visited: set) -> None:
    """The `*.gguf` files under `d` by folder, `depth` folders deep at most, each folder once (a link
    back up the tree is not followed again)."""
    try:
        st = os.stat(d)
    except OSError:
        return
    if (st.st_dev, st.st_ino) in visited:
        return
    visited.add((st.st_dev, st.st_ino))
    found = _list_gguf(d, root, b, regular_only=True)
    if found:
        files[d] = found
    if depth > 0:
        for sub in _subdirs(d, root, b):
            _tree(sub, root, b, depth - 1, files, visited)


def _hf_label(folder: Path, root: Root) -> str:
    """`org/name` of the Hub repository a snapshot folder belongs to."""
    rel = folder.relative_to(root.path).parts
    return rel[0].removeprefix("models--").replace("--", "/", 1) if rel else ""


# ---- one folder's files: split sets, projectors and drafters ---------------------------------------
def is_companion(name: str) -> str:
    """'mmproj' or 'mtp' for a vision projector or an MTP drafter file name, else ''."""
    n = name.lower()
    return "mmproj" if n.startswith("mmproj") else "mtp" if n.startswith("mtp-") else ""


def model_stem(p: Path) -> str:
    """The name a model's companions mention: a split set's name without its part number, else the stem."""
    sn = split_name(p)
    return sn.prefix if sn is not None else p.stem


def group_folder(paths: list[Path], source: str, label: str = "") -> list[FoundModel]:
    """One folder's `*.gguf` files as models: a split set once (by its first part, or by a later part
    when the first is absent, whose load then says so), mmproj-/mtp- files paired with the model they
    name (or the folder's only model) and not listed."""
    names = {p.name.lower() for p in paths}
    models, companions, sets = [], [], set()
    for p in sorted(paths, key=lambda q: q.name):
        if is_companion(p.name):
            companions.append(p)
            continue
        sn = split_name(p)
        if sn is not None:
            key = (sn.prefix.lower(), sn.count)
            if key in sets or (sn.no > 1 and sn.first.name.lower() in names):
                continue
            sets.add(key)
        models.append(p)
    paired: dict[Path, dict] = {m: {} for m in models}
    for c in companions:
        target = _owner(c, models)
        if target is not None:
            paired[target].setdefault(is_companion(c.name), c)
    return [FoundModel(m, source, label, _parts(m), paired[m].get("mmproj"), paired[m].get("mtp"))
            for m in models]


def _parts(p: Path) -> int:
    sn = split_name(p)
    return sn.count if sn is not None else 1


def _owner(companion: Path, models: list[Path]) -> Path | None:
    stem = companion.stem.lower()
    named = [m for m in models if model_stem(m).lower() in stem]
    if named:
        return max(named, key=lambda m: len(model_stem(m)))     # the most specific name
    return models[0] if len(models) == 1 else None


# ---- Ollama ----------------------------------------------------------------------------------------
def _ollama(root: Root, b: _Budget) -> list[FoundModel]:
    manifests: list[Path] = []
    _manifest_files(root.path / "manifests", root, b, 5, manifests, set())
    out = []
    for m in manifests:
        found = _from_manifest(root, m, b)
        if found is not None:
            out.append(found)
    return out


def _manifest_files(d: Path, root: Root, b: _Budget, depth: int, out: list, visited: set) -> None:
    try:
        st = os.stat(d)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in visited:
        return
    visited.add((st.st_dev, st.st_ino))
    for e in _entries(d, root, b):
        if e.name.startswith("."):
            continue
        if _entry_is_dir(e):
            if depth > 0:
                _manifest_files(Path(e.path), root, b, depth - 1, out, visited)
        else:
            out.append(Path(e.path))


def _from_manifest(root: Root, path: Path, b: _Budget) -> FoundModel | None:
    """The model a manifest names, when its blob is there; None (a note when it is unreadable) else."""
    try:
        with open_regular(path) as f:          # a FIFO or a device: refused, never waited on
            raw = f.read(MANIFEST_BYTES + 1)
        if len(raw) > MANIFEST_BYTES:
            raise ValueError(f"over {MANIFEST_BYTES >> 10} KiB")
        data = json.loads(raw)
    except (OSError, ValueError, ModelFileError) as e:
        b.notes.append(f"{root.source}: manifest {path.name} not read ({getattr(e, 'strerror', None) or e})")
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        return None
    model, projector = _blob(root, layers, MODEL_MEDIA), _blob(root, layers, PROJECTOR_MEDIA)
    if model is None:
        return None
    rel = path.relative_to(root.path / "manifests").parts      # registry, namespace, model, tag
    name = ":".join(rel[-2:]) if len(rel) >= 2 else path.name
    if len(rel) >= 3 and rel[-3] != "library":
        name = f"{rel[-3]}/{name}"
    return FoundModel(model, root.source, name, 1, projector, None)


def _blob(root: Root, layers: list, media: str) -> Path | None:
    for layer in layers:
        if not isinstance(layer, dict) or layer.get("mediaType") != media:
            continue
        m = _DIGEST.match(str(layer.get("digest", "")))
        if m is None:
            return None
        blob = root.path / "blobs" / f"sha256-{m.group(1)}"
        try:
            return blob if stat.S_ISREG(os.stat(blob).st_mode) else None
        except OSError:
            return None
    return None
