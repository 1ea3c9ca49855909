"""The child side of the fuzz suite: loads hostile inputs under an address-space cap and reports each.

Run as `python tests/fuzz_worker.py MEMORY_CAP_BYTES`; reads one JSON job a line on stdin, answers one
JSON line on stdout:
    {"kind": "gguf", "path": P, "estimate": bool}   the memory estimate (when asked), then open +
                                            tokenizer + model + one forward pass, as Engine._load
    {"kind": "mtp", "path": P, "target": T}  a Gemma 4 MTP drafter loaded beside its gemma4 target
    {"kind": "template", "source": S, "messages": [...]}   engine.text.chat_template.render
    {"kind": "image", "path": P}            engine.vision.images.decode_image on the file's bytes
Answer: {"outcome": "accepted" | "refused" | "crash", "detail": str}. "refused" is a StrataError with
a one-line message (for images, an ImageRefused); anything else raised is a "crash" with its traceback. A hang or a death (the cap
hit in C, a signal) is seen by the parent (tests/fuzz_harness.py), which kills and restarts this.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _estimate(path: str):
    """`strata models estimate`'s path (and the app's model list): the header alone, no mlx. Returns its
    refusal (a StrataError) or None."""
    from engine.model import memory_estimate as me
    from engine.errors import StrataError
    try:
        h = me.read_header(path)
        me.check_fit(h, me.default_context(h), "float32", None)
    except StrataError as e:
        return e
    return None


def _gguf(job: dict) -> str:
    import mlx.core as mx

    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.text.tokenizer import load_tokenizer
    # the estimate first, as a load does (engine/handlers.py); both paths must end well on their own, so
    # the load runs even when the estimate refused
    refused = _estimate(job["path"]) if job.get("estimate") else None
    g = open_gguf(job["path"])
    tok = load_tokenizer(g)
    model, info = load_model(g)
    ids = tok.encode("Hello there", add_bos=True)[:4] or [0]
    mx.eval(model(mx.array([ids])))
    if refused is not None:
        raise refused
    return f"{info.n_layer} layers, width {info.n_embd}"


_TARGETS: dict = {}         # target path -> (GGUFFile, model): the drafter jobs' target, loaded once


def _mtp(job: dict) -> str:
    """A Gemma 4 MTP drafter read beside its target, as `--spec mtp` does (engine/model/archs/gemma4_mtp.py)."""
    from engine.model.archs.gemma4_mtp import load_sibling
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    if job["target"] not in _TARGETS:
        g = open_gguf(job["target"])
        _TARGETS[job["target"]] = (g, load_model(g)[0])
    target_g, model = _TARGETS[job["target"]]
    _, note = load_sibling(job["path"], model, target_g)
    return note


def _template(job: dict) -> str:
    from engine.text.chat_template import render
    text = render(job["source"], job.get("messages") or [{"role": "user", "content": "hi"}],
                  bos_token="<s>", eos_token="</s>", name="fuzzed template")
    return f"{len(text)} characters"


def _image(job: dict) -> str:
    from engine.vision.images import decode_image
    with open(job["path"], "rb") as f:
        got = decode_image(f.read())
    if got.rgb.shape != (got.height, got.width, 3) or got.rgb.dtype.name != "uint8":
        raise AssertionError(f"decoded to {got.rgb.shape} {got.rgb.dtype}, not ({got.height}, {got.width}, 3) uint8")
    return f"{got.format} {got.width}x{got.height}"


def main() -> None:
    cap = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from engine.text import chat_template
    from engine.errors import StrataError
    from engine.vision.images import ImageRefused
    chat_template.TIME_BUDGET_S = float(os.environ.get("STRATA_FUZZ_TEMPLATE_BUDGET_S", "1.0"))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            detail = {"gguf": _gguf, "mtp": _mtp, "template": _template, "image": _image}[job["kind"]](job)
            out = {"outcome": "accepted", "detail": detail}
        except (StrataError, ImageRefused) as e:
            msg = str(e)
            out = {"outcome": "refused" if msg and "\n" not in msg else "crash", "detail": msg}
        except BaseException:  # noqa: BLE001 - this is what the fuzz suite is looking for
            out = {"outcome": "crash", "detail": traceback.format_exc()[-2000:]}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
