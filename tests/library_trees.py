"""Generated folder trees laid out as other apps keep their model libraries (engine/model/model_sources.py):
LM Studio's models folder, the Hugging Face hub cache (snapshot links into blobs) and Ollama's store
(manifests naming sha256 blobs). Each takes a home folder and real GGUF files to place."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def lm_studio(home: Path, files: dict[str, Path], old: bool = False) -> Path:
    """`files` ("publisher/repo/name.gguf" -> a GGUF) copied into LM Studio's models folder."""
    root = home / (".cache/lm-studio/models" if old else ".lmstudio/models")
    for rel, src in files.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    return root


def hf_cache(root: Path, repo: str, files: dict[str, Path], revisions: int = 1) -> Path:
    """`files` ("name.gguf" or "sub/name.gguf" -> a GGUF) in the hub cache at `root` as the Hub client
    stores them: blobs named by their hash, each snapshot's file a relative symlink to its blob. Every
    revision links the same blobs (the same file reached twice). Returns the repository folder."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blobs = repo_dir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digests = {}
    for rel, src in files.items():
        digest = hashlib.sha256(Path(src).read_bytes()).hexdigest()
        if not (blobs / digest).exists():
            shutil.copyfile(src, blobs / digest)
        digests[rel] = digest
    for r in range(revisions):
        snap = repo_dir / "snapshots" / f"{r:040x}"
        for rel, digest in digests.items():
            link = snap / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blobs / digest, link.parent), link)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(f"{revisions - 1:040x}")
    return repo_dir


def ollama(root: Path, name: str, tag: str, model: Path, projector: Path | None = None,
           namespace: str = "library") -> Path:
    """`model` (and a vision projector) in Ollama's store at `root` under `namespace/name:tag`: blobs
    named sha256-<hex>, a manifest naming them by media type. Returns the model's blob."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    layers = []
    for media, src in (("application/vnd.ollama.image.model", model),
                       ("application/vnd.ollama.image.projector", projector)):
        if src is None:
            continue
        data = Path(src).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)})
    layers.append({"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64,
                   "size": 10})
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": {}, "layers": layers}))
    return blobs / f"sha256-{hashlib.sha256(Path(model).read_bytes()).hexdigest()}"
