"""Starting an engine for a front end: the engine flags (`strata generate|serve|replay`), their
checks, and `start_engine` (an Engine with its model loaded, or the start-up load's one-line error).

The front ends (cli, server, replay) import this module; it imports none of them (no import circle).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.errors import StrataError
from engine.limits import (DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS, DEFAULT_DISK_MIB, DEFAULT_MAX_SEQUENCES, KV_BITS,
                           MAX_SEQUENCES_MAX, SLOTS_MAX, SPEED_PROJECTION_DEFAULT, check_cache_mib, check_cache_slots,
                           check_disk_mib)
from engine.model.models import default_model_path
from engine.paths import check_data_dir


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="GGUF path or a name in the models folder")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's, capped at 8192)")
    p.add_argument("--conversation-cache-mib", type=int, default=DEFAULT_CACHE_MIB,
                   help="RAM for parked conversations' K/V, 0 (off) to half of this machine's RAM")
    p.add_argument("--conversation-cache-slots", type=int, default=DEFAULT_CACHE_SLOTS,
                   help=f"parked conversations, 1 to {SLOTS_MAX}")
    p.add_argument("--conversation-disk-mib", type=int, default=DEFAULT_DISK_MIB,
                   help="disk for conversations' K/V under parking (the data folder's cache/conversations; "
                        f"found again after an eviction or a restart), 0 = off; default {DEFAULT_DISK_MIB}")
    p.add_argument("--control-vector", action="append", default=[], metavar="FILE")
    p.add_argument("--control-vector-scaled", action="append", default=[], metavar="FILE:SCALE")
    p.add_argument("--control-vector-layer-range", nargs=2, type=int, metavar=("A", "B"))
    p.add_argument("--cvec-mode", choices=("add", "project"), default="add")
    p.add_argument("--cvec-dir", default="per-layer", help="per-layer | single:L")
    p.add_argument("--speed-projection", choices=("on", "off"), default="on" if SPEED_PROJECTION_DEFAULT else "off",
                   help="apply the loaded control vector to requests that name no setting")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None)
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=16,
                   help="K/V cache storage: 16-bit, or 8/4-bit quantized (mlx-lm's QuantizedKVCache)")
    p.add_argument("--mmproj", default=None, metavar="PATH",
                   help="the model's image projector (an mmproj GGUF); default: an mmproj-*.gguf beside the "
                        "model; '' for none")
    p.add_argument("--image-max-tokens", type=int, default=0, metavar="N",
                   help="the most tokens one image takes with a dynamic-size projector (Gemma 4: 70..1120, "
                        "Qwen3.5/3.6: 8..4096, Mistral 3: 8..1024; a larger image is scaled down); "
                        "default: the projector's own limit (gemma3: always 256)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the engine log to stderr")
    p.add_argument("--max-sequences", type=int, default=DEFAULT_MAX_SEQUENCES, metavar="N",
                   help=f"requests decoded together in one batch, the rest queue (default {DEFAULT_MAX_SEQUENCES}; "
                        "1 = one at a time)")


def check_engine_flags(args) -> None:
    """Flags with a valid range (engine.limits), checked before anything is loaded: StrataError, one line."""
    check_cache_mib(args.conversation_cache_mib, what="--conversation-cache-mib")
    check_cache_slots(args.conversation_cache_slots, what="--conversation-cache-slots")
    check_disk_mib(args.conversation_disk_mib, what="--conversation-disk-mib")
    if not 1 <= args.max_sequences <= MAX_SEQUENCES_MAX:
        raise StrataError(f"--max-sequences must be 1 to {MAX_SEQUENCES_MAX}; got {args.max_sequences}")
    unusable = check_data_dir()       # sessions, models, the disk cache: before the model loads
    if unusable:
        raise StrataError(unusable)
    mmproj = getattr(args, "mmproj", None)
    if mmproj:                      # a path that is no file is refused before the model loads
        if not Path(mmproj).expanduser().is_file():
            raise StrataError(f"--mmproj: no such file: {mmproj}")
    if args.ctx is not None and args.ctx < 16:  # 0 or a negative used to pass as "the model's own"
        # (too large a context is refused by the memory estimate at load, with the numbers)
        raise StrataError(f"--ctx must be at least 16 tokens (omit it for the model's own); got {args.ctx}")


def engine_options(args):
    # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
    from engine.steer.control_vector import SteeringConfig
    # lazy: the engine's request types cost `strata --help` a third more start-up
    from engine.api import EngineOptions
    check_engine_flags(args)
    files = [(f, 1.0) for f in args.control_vector]
    files += [SteeringConfig.parse_scaled(s) for s in args.control_vector_scaled]
    steering = None
    if files:
        steering = SteeringConfig(files=tuple(files), mode=args.cvec_mode, direction=args.cvec_dir,
                                  layer_range=tuple(args.control_vector_layer_range)
                                  if args.control_vector_layer_range else None)
    return EngineOptions(model=args.model or str(default_model_path()), context_length=args.ctx,
                         cache_mib=args.conversation_cache_mib, cache_slots=args.conversation_cache_slots,
                         steering=steering, speed_projection=args.speed_projection == "on", dtype=args.dtype,
                         kv_bits=args.kv_bits, disk_mib=args.conversation_disk_mib,
                         max_sequences=args.max_sequences, draft=_draft_of(getattr(args, "spec", None)),
                         mmproj=getattr(args, "mmproj", None), image_max_tokens=getattr(args, "image_max_tokens", 0))


def _draft_of(spec: str | None) -> str | None:
    """--spec draft:PATH: the draft loads with the model at start (one unit), not in the first request."""
    # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
    from engine.generation.speculative import parse_spec
    mode = parse_spec(spec)
    return mode.draft_path if mode.kind == "draft" else None


def start_engine(args, wait: bool = True):
    """An engine with the model loaded, or EngineError with the start-up load's own message.
    wait=False: the engine with its start-up load under way (then `loaded(engine)` waits for it)."""
    # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
    from engine.engine import Engine
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    engine = Engine(engine_options(args)).start()
    return loaded(engine) if wait else engine


def loaded(engine):
    """`engine` once its start-up load is done, or EngineError (StrataError) with the load's message."""
    result = engine.startup.result()            # the start-up load's ModelLoaded, or its EngineError
    if result.steering_error:
        # On the command line the vector was asked for explicitly: refuse rather than run without it.
        raise StrataError(result.steering_error)
    return engine


def follow(args) -> int:
    """`strata generate|serve|replay` on a rank other than 0: load the same model, then serve rank 0's
    requests until rank 0 stops (or is lost)."""
    # lazy: it pulls in MLX, which `strata --help` and the flag checks start without
    from engine.ranks.distributed import FollowerGuard
    from engine.engine import Engine
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        stream=sys.stderr)
    engine = Engine(engine_options(args))
    engine.guard = FollowerGuard(engine.guard)
    engine.run_forever()
    return 0
