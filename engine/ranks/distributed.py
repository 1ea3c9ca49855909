"""One model across several processes (or machines) on MLX's distributed layer (mx.distributed).

Started the way MLX users start any distributed program: `mlx.launch --hostfile hosts.json -- strata ...`
or by hand with MLX_RANK / MLX_HOSTFILE set (the ring backend over TCP; jaccl/nccl where MLX has them).
Without those variables nothing here runs and the engine is the single-process one.

Every rank runs the same Engine, with a `Distributed` as its serving strategy (engine/serving.py: the
interface `LocalServing` has for one process). Rank 0 serves callers (CLI, server, app); before it serves a request
that touches the model it broadcasts the request to the other ranks, which serve it too, so every
rank walks the same code in lockstep: the same prompt tokens, the same K/V bookkeeping (live entry,
parking, trims), the same sampled tokens (the logits are broadcast and a request without a seed gets
one from rank 0). Only the model call and the session files talk across ranks.

Modes (STRATA_DIST_MODE): "pipeline" (default, every architecture; contiguous layer ranges per rank)
or "tensor" (mlx-lm's shard(): heads and the MLP split over ranks; needs head counts divisible by
the group size).

A rank that dies breaks the ring: rank 0's pending collective raises, or, when a peer hangs, the
watchdog notices that no model step completed within STRATA_DIST_TIMEOUT seconds. Either way the
request fails with a "distributed: ..." message, and every later request fails at once with it (the
server answers 503) instead of waiting on a ring that is gone.
"""
from __future__ import annotations

import os
import pickle
import random
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.errors import ErrorCode, StrataError, RequestError
from engine.events import Progress, Failed
from engine.cache import parking
from engine.ranks import pipeline_sessions
from engine.model import archs
from engine.session_files import sessions
from engine.api import (Configure, GenerateRequest, LoadModel, RestoreSession, SaveSession, SessionRestored,
                        SessionSaved)
from engine.model.model_loader import load_model, model_args
from engine.cache.parking import KVEntry
from engine.ranks.pipeline_model import PipelineModel, PipelinePart, TensorModel, embeds_everywhere, split_for
from engine.steer.steering import SteeredLayer

MODE_ENV = "STRATA_DIST_MODE"
TIMEOUT_ENV = "STRATA_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


class DistributedError(StrataError):
    """A rank was lost or disagreed: the engine cannot serve (ErrorCode.UNAVAILABLE)."""
    error_code = ErrorCode.UNAVAILABLE
    reason = "distributed"


def launched() -> bool:
    """Whether this process was started as one rank of several (mlx.launch or by hand)."""
    return "MLX_RANK" in os.environ and bool(os.environ.get("MLX_HOSTFILE") or os.environ.get("MLX_JACCL_COORDINATOR")
                                             or os.environ.get("NCCL_HOST_IP") or os.environ.get("OMPI_COMM_WORLD_SIZE"))


def is_follower() -> bool:
    """A rank other than 0 (known from the environment, before MLX is initialised)."""
    return launched() and os.environ.get("MLX_RANK", "0") != "0"


@dataclass
class Distributed:
    """The serving strategy of one rank (engine/serving.py's `Serving`)."""
    group: object
    rank: int
    size: int
    mode: str
    backend: str
    timeout_s: float
    split: list = field(default_factory=list)        # [(start, end)] per rank (pipeline)
    broken: str | None = None                         # why the ring is unusable, once it is
    _busy_since: float | None = None
    _handle: object = None
    distributed = True                                # class attribute: what serving.LocalServing says False to

    @property
    def leads(self) -> bool:
        """Rank 0 takes requests from its queue; the others serve rank 0's (next_request)."""
        return self.rank == 0

    # ---- load ----------------------------------------------------------------------------------
    def load_model(self, g, dtype, progress):
        """The model part this rank holds (pipeline) or its shard (tensor), and the full ModelInfo."""
        _, args = model_args(g)
        if self.mode == "tensor":
            if archs.find(g.architecture) is not None:
                # TensorModel applies the head itself (not a family's logit scaling or soft-capping) and
                # mlx-lm's shard() is not written for every family: refused rather than wrong
                raise DistributedError(f"distributed: tensor parallel does not support {g.architecture} files; "
                                       f"use {MODE_ENV}=pipeline")
            n = self.size
            if args.num_attention_heads % n or args.num_key_value_heads % n or args.intermediate_size % n:
                raise DistributedError(
                    f"distributed: tensor parallel needs the head counts ({args.num_attention_heads} query, "
                    f"{args.num_key_value_heads} K/V) and the MLP width ({args.intermediate_size}) divisible "
                    f"by {n} ranks; use {MODE_ENV}=pipeline")
            model, info = load_model(g, dtype=dtype, progress=progress)
            model.shard(self.group)
            mx.eval(model.parameters())
            return TensorModel(model, self.group, self.rank, args.tie_word_embeddings), info
        try:
            self.split = split_for(args, self.size)
        except ValueError as e:
            raise DistributedError(f"distributed: {e}") from None
        start, end = self.split[self.rank]
        part = PipelinePart(self.rank, self.size, start, end, args.num_hidden_layers, embeds_everywhere(args))
        inner, info = load_model(g, dtype=dtype, progress=progress, part=part)
        model = PipelineModel(inner, part, self.group, args.vocab_size, args.hidden_size,
                              args.tie_word_embeddings, dtype)
        parking.WHOLE_MODEL_LAYERS[:] = [args.num_hidden_layers, end - start]
        return model, info

    def after_load(self, engine) -> None:
        """Hooks on a freshly loaded model: watchdog heartbeat, global steering layer numbers, and
        parking that admits only what every rank's memory guard admits."""
        parking = engine.conversations.parking
        if not isinstance(parking.guard, LockstepGuard):
            parking.guard = LockstepGuard(parking.guard, self)
        self.after_install(engine.model)

    def after_install(self, model) -> None:
        """Steering wrappers are numbered locally; the control vector is indexed by global layer."""
        model.on_step = self.step
        if self.mode != "pipeline":
            return
        start = self.split[self.rank][0]
        for block in model.model.layers:
            if isinstance(block, SteeredLayer) and not getattr(block, "global_index", False):
                block.layer_index += start
                block.global_index = True

    def describe(self) -> str:
        if self.mode == "tensor":
            return f"distributed: tensor parallel over {self.size} ranks ({self.backend}), this is rank {self.rank}"
        parts = ", ".join(f"rank {r}: layers {a}..{b - 1}" for r, (a, b) in enumerate(self.split))
        return f"distributed: pipeline over {self.size} ranks ({self.backend}): {parts}; this is rank {self.rank}"

    def status(self) -> dict:
        return {"mode": self.mode, "ranks": self.size, "rank": self.rank, "backend": self.backend,
                "split": [list(s) for s in self.split] if self.mode == "pipeline" else None,
                "broken": self.broken}

    # ---- lockstep requests ---------------------------------------------------------------------
    def _bytes_collective(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (an all_sum where the others add zeros)."""
        n = mx.array([len(data) if data is not None else 0], dtype=mx.int32)
        n = int(mx.distributed.all_sum(n, group=self.group).item())
        buf = mx.array(np.frombuffer(data, dtype=np.uint8).astype(np.int32)) if data is not None \
            else mx.zeros((n,), dtype=mx.int32)
        out = mx.distributed.all_sum(buf, group=self.group)
        mx.eval(out)
        return np.asarray(out).astype(np.uint8).tobytes()

    def announce(self, handle) -> None:
        """Rank 0: send the request to the followers before serving it (replicated requests only)."""
        req = handle.request
        if isinstance(req, GenerateRequest):
            if req.sampling.seed is None:
                # Every rank samples from the same logits; the same seed makes them draw the same token.
                req.sampling.seed = random.randrange(1 << 31)
        self._collective(lambda: self._bytes_collective(pickle.dumps(req)), handle)

    def stop(self) -> None:
        """Rank 0 stops: so do the followers (a broken ring has no one left to tell)."""
        if self.rank != 0 or self.broken:
            return
        try:
            self._bytes_collective(pickle.dumps(Stop()))
        except RuntimeError:
            pass                        # a follower already gone stops on its own

    def next_request(self):
        """Followers: rank 0's next request (blocks until there is one), None once rank 0 stops."""
        req = pickle.loads(self._bytes_collective(None))
        return None if isinstance(req, Stop) else req

    # ---- watchdog ------------------------------------------------------------------------------
    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="strata-dist-watchdog", daemon=True).start()

    def step(self) -> None:
        """A model step completed (called per model call): the ring is alive."""
        if self._busy_since is not None:
            self._busy_since = time.monotonic()

    def _watch(self) -> None:
        while self.broken is None:
            time.sleep(0.2)
            since, handle = self._busy_since, self._handle
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.broken = (f"distributed: no answer from the other ranks for {self.timeout_s:.0f} s "
                               f"(a rank died or hangs); restart every rank")
                if handle is not None and not handle.finished.is_set():
                    handle.emit(Failed(self.broken, ErrorCode.UNAVAILABLE, "distributed"))

    def _collective(self, fn, handle):
        if self.broken:
            raise DistributedError(self.broken)
        self._busy_since, self._handle = time.monotonic(), handle
        try:
            return fn()
        except RuntimeError as e:
            if self.broken is None:
                self.broken = f"distributed: lost a rank ({e}); restart every rank"
            raise DistributedError(self.broken) from None
        finally:
            self._busy_since, self._handle = None, None

    def dispatch(self, engine, handle):
        """Serve one request under the watchdog, ring errors as one line. A replicated request (one
        every rank serves) ends with a check that every rank succeeded on the same model file."""
        replicated = _replicated(handle.request)
        if self.rank == 0 and replicated and not getattr(handle, "local", False):
            self.announce(handle)
        if not replicated:
            return engine.dispatch(handle)
        req = handle.request
        if isinstance(req, SaveSession):        # rank 0 gathers every rank's layers into one file
            serve = lambda: SessionSaved.from_dict(self.save(engine, req, handle))  # noqa: E731
        elif isinstance(req, RestoreSession):   # rank 0 reads it, each rank gets its layers
            serve = lambda: SessionRestored.from_dict(self.restore(engine, req, handle))  # noqa: E731
        else:
            serve = lambda: engine.dispatch(handle)  # noqa: E731
        if isinstance(handle.request, GenerateRequest) and isinstance(engine.model, (PipelineModel, TensorModel)):
            LockstepCancel.install(handle, engine.model, rank0=self.rank == 0)
        error = None
        try:
            result = self._collective(serve, handle)
        except DistributedError:
            raise                       # the ring itself is gone: no check can run
        except StrataError as e:
            error, result = e, None
            engine.log(f"distributed: this rank failed the request: {e}")   # what "see their log" means
        self._collective(lambda: self._check_agree(error is None, engine.model_hash), handle)
        if error is not None:
            raise error
        return result

    def _check_agree(self, ok: bool, model_hash: str) -> None:
        """all_gather of (succeeded, model content hash) from every rank: a request that failed on
        some ranks only, or ranks holding different model files, leave them out of step for good."""
        raw = bytes.fromhex(model_hash) if model_hash else b""
        row = np.zeros(17, dtype=np.int32)
        row[0] = int(ok)
        row[1:1 + len(raw[:16])] = np.frombuffer(raw[:16], dtype=np.uint8)
        rows = np.asarray(mx.distributed.all_gather(mx.array(row)[None], group=self.group)).reshape(self.size, 17)
        failed = [r for r in range(self.size) if not rows[r, 0]]
        if failed and len(failed) < self.size:
            self.broken = (f"distributed: rank(s) {', '.join(map(str, failed))} failed a request the others "
                           f"served (see their log); restart every rank")
            raise DistributedError(self.broken)
        if not failed and any((rows[r, 1:] != rows[0, 1:]).any() for r in range(self.size)):
            self.broken = ("distributed: the ranks loaded different model files (content hashes differ); "
                           "give every rank the same GGUF and restart them")
            raise DistributedError(self.broken)

    # ---- sessions ------------------------------------------------------------------------------
    # One file for the whole model, written and read by rank 0 only (the followers may be other
    # machines): rank 0 gathers each rank's layers for a save and sends each rank its layers on a
    # restore. The file is the single-process format, so it restores on one machine and back.
    def _decide(self, error: str | None) -> None:
        """Rank 0's go/no-go on every rank (a check that could differ per rank must not split them)."""
        verdict = pickle.loads(self._bytes_collective(pickle.dumps(error) if self.rank == 0 else None))
        if verdict:
            raise RequestError(verdict)

    def save(self, engine, req, handle) -> dict:
        engine.require_model()
        # The same choice as Engine._save (every rank holds the same entries in the same order).
        entry = engine.conversations.live
        if req.messages is not None:
            key = engine.handlers.cache_key()
            entry = next((e for e in engine.conversations.held() if e.messages == req.messages and e.key == key),
                         None)
        error = None
        if entry is None and req.messages is not None:
            error = ("that conversation's K/V is no longer held by the engine "
                     "(send a message in it first, then save)")
        elif entry is None or not entry.tokens:
            error = "there is no conversation to save"
        elif self.rank == 0 and engine.guard.unavailable_reason():
            error = f"session save refused: {engine.guard.unavailable_reason()}"
        self._decide(error)
        if self.mode == "pipeline":         # any cache kinds, through the cache contract
            full = pipeline_sessions.gather(self, entry.cache, engine.model)
            checkpoints = pipeline_sessions.gather_checkpoints(self, entry, engine.model)
        else:
            full, checkpoints = self._gather(entry), []
        result, error = None, None
        if self.rank == 0:
            whole = KVEntry(entry.tokens, full, entry.key, messages=entry.messages)
            whole.checkpoints = checkpoints
            try:
                result = sessions.save(req.path, whole, engine.sessions.fingerprint(),
                                       progress=lambda d, t: handle.emit(Progress("save", d, t)), log=engine.log)
            except StrataError as e:
                error = str(e)
        # A failed write (disk full, a folder in the way) fails the request on every rank, in step.
        self._decide(error)
        return result if result is not None else {"tokens": len(entry.tokens)}

    def restore(self, engine, req, handle) -> dict:
        engine.require_model()
        n_layer = engine.info.n_layer
        # Pipeline: any cache kinds, through the cache contract (engine/ranks/pipeline_sessions.py); a format-3
        # file is checked against the whole model's one-token probe, which every rank runs together.
        pipeline = self.mode == "pipeline"
        probe = (pipeline_sessions.probe(self, engine.model, engine.handlers.make_cache)
                 if pipeline and pipeline_sessions.needs_probe(engine.model) else None)
        whole, result, error = None, None, None
        if self.rank == 0:
            try:
                reason = engine.guard.unavailable_reason()
                if reason:
                    raise RequestError(f"session restore refused: {reason}")
                whole, result = sessions.load(req.path, engine.sessions.fingerprint(),
                                              (lambda: pipeline_sessions.whole_cache(engine)) if pipeline
                                              else (lambda: [KVCache() for _ in range(n_layer)]),
                                              key=engine.handlers.cache_key(), dtype=engine.dtype,
                                              progress=lambda d, t: handle.emit(Progress("restore", d, t)),
                                              log=engine.log, probe_cache=(lambda: probe) if probe else None)
            except StrataError as e:
                error = str(e)
        self._decide(error)
        head = pickle.loads(self._bytes_collective(
            pickle.dumps((whole.tokens, whole.messages)) if self.rank == 0 else None))
        tokens, messages = head
        # Every layer travels as a broadcast from rank 0 (all_sum with zeros from the others): exact, in
        # order, and it works on any ring (send/recv reach only neighbours); the rank owning it keeps it.
        shape = (1, engine.info.n_head_kv, len(tokens), engine.info.head_dim)
        mine = []
        for i in range(0 if pipeline else n_layer):
            owner = next(r for r, (a, b) in enumerate(self.split) if a <= i < b) if self.split else self.rank
            kv = []
            for arr in ("keys", "values"):
                # the held cells only: a restored cache is padded past them (room to grow in place)
                x = getattr(whole.cache[i], arr)[:, :, :len(tokens), :] if self.rank == 0 else None
                x = self._broadcast(0, x, shape, engine.dtype)
                if self.mode == "tensor":     # this rank's contiguous K/V heads (as shard_linear splits)
                    h = shape[1] // self.size
                    x = x[:, self.rank * h:(self.rank + 1) * h]
                kv.append(x)
            if owner == self.rank:
                c = KVCache()
                c.state = (*kv, len(tokens))
                mine.append(c)
        cache, checkpoints = pipeline_sessions.scatter(self, whole.cache if self.rank == 0 else None,
                                                       whole.checkpoints if self.rank == 0 else None,
                                                       engine.model) \
            if pipeline else (engine.handlers.make_cache(), [])
        for dst, src in zip(cache, mine):           # tensor mode (pipeline: scattered above)
            dst.state = (src.keys, src.values, len(tokens))
        entry = KVEntry(list(tokens), cache, engine.handlers.cache_key(), messages=messages)
        entry.checkpoints = checkpoints
        entry.owner = req.conversation          # as Engine._restore: the follow-up finds it by its owner
        # As Engine._restore: only now does the live conversation step aside.
        engine.conversations.make_live(entry)
        # The CLI and the app continue with the file's steering, as after Engine._restore.
        steer = engine.handlers.steering_fingerprint()
        return {**(result if result is not None else {"restored_tokens": len(tokens)}),
                "speed_projection": bool(steer), "steering": {"fingerprint": steer} if steer else None}

    def _gather(self, entry):
        """Rank 0: every layer's K/V in order; the other ranks contribute theirs (see restore)."""
        n = len(entry.tokens)
        ref = entry.cache[0].keys
        shape = tuple(ref.shape[:2]) + (n,) + tuple(ref.shape[3:])
        full = []
        if self.mode == "tensor":
            # Every rank holds every layer's K/V for its own heads: concatenated in rank order.
            for c in entry.cache:
                kv = []
                for arr in ("keys", "values"):
                    x = mx.distributed.all_gather(getattr(c, arr)[..., :n, :], group=self.group)
                    mx.eval(x)
                    kv.append(x.reshape(1, -1, n, shape[3]))
                k = KVCache()
                k.state = (*kv, n)
                full.append(k)
            return full if self.rank == 0 else None
        for r, (a, b) in enumerate(self.split):
            for j in range(b - a):
                kv = [self._broadcast(r, getattr(entry.cache[j], arr)[..., :n, :] if r == self.rank else None,
                                      shape, ref.dtype) for arr in ("keys", "values")]
                if self.rank == 0:
                    c = KVCache()
                    c.state = (*kv, n)
                    full.append(c)
        return full if self.rank == 0 else None

    def _broadcast(self, src: int, x, shape, dtype):
        """`x` from rank `src` on every rank."""
        if self.rank != src:
            x = mx.zeros(shape, dtype=dtype)
        out = mx.distributed.all_sum(x, group=self.group)
        mx.eval(out)
        return out


def _replicated(req) -> bool:
    """Requests every rank serves (they touch the model or the K/V); Status stays on rank 0."""
    return isinstance(req, (GenerateRequest, LoadModel, RestoreSession, SaveSession, Configure))


class Stop:
    """Rank 0 is stopping: the followers stop too."""


def detect() -> Distributed | None:
    """Initialise mx.distributed when launched as a rank; None for a single process."""
    if not launched():
        return None
    backend = os.environ.get("STRATA_DIST_BACKEND", "any")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise DistributedError(f"distributed: cannot join the group ({e})") from None
    if group.size() < 2:
        return None
    mode = os.environ.get(MODE_ENV, "pipeline")
    if mode not in ("pipeline", "tensor"):
        raise DistributedError(f"distributed: {MODE_ENV} must be pipeline or tensor, not {mode!r}")
    try:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        raise DistributedError(f"distributed: {TIMEOUT_ENV} must be a number of seconds") from None
    d = Distributed(group, group.rank(), group.size(), mode, backend, timeout)
    if d.rank == 0:
        d.start_watchdog()
    return d


class LockstepCancel:
    """Stands in for a Handle's cancel event in pipeline mode: cancel() (rank 0's button: the app, a
    client that went away) is sent with the next model step, and is_set() is the flag every rank
    received with the latest step, so all ranks stop after the same token."""

    def __init__(self, model, requested: bool):
        self.model, self.requested = model, requested

    @classmethod
    def install(cls, handle, model, rank0: bool) -> None:
        lc = cls(model, handle.cancelled)
        handle._cancel = lc
        model.last_flag = None
        model.cancel_source = (lambda: lc.requested) if rank0 else None

    def set(self) -> None:
        self.requested = True

    def is_set(self) -> bool:
        flag = self.model.last_flag
        return flag is not None and float(flag.item()) > 0


class LockstepGuard:
    """The parking's memory guard on every rank: each rank asks its own guard, and a refusal on any
    rank refuses on all (the smallest headroom decides), so every rank parks and evicts alike.
    Parking runs inside replicated requests only, so every rank reaches each check together."""

    def __init__(self, inner, dist: "Distributed"):
        self.inner, self.dist = getattr(inner, "inner", inner), dist

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _agree(self, refusal: str | None) -> str | None:
        flags = mx.distributed.all_gather(mx.array([[int(refusal is not None)]], dtype=mx.int32),
                                          group=self.dist.group)
        refusing = [r for r, f in enumerate(np.asarray(flags).reshape(-1)) if f]
        if not refusing:
            return None
        if refusal is not None:
            return refusal
        return f"rank {refusing[0]}'s memory guard refuses (see its log)"

    def unavailable_reason(self):
        return self._agree(self.inner.unavailable_reason())

    def admit(self, nbytes: int):
        ok, why = self.inner.admit(nbytes)
        why = self._agree(None if ok else why)
        return why is None, why or ""


class FollowerGuard:
    """A follower parks, evicts and saves on rank 0's decisions: its own memory guard reads and
    reports, but never refuses (a refusal here alone would split the ranks' K/V bookkeeping).
    Known gap: rank 0 decides alone; the smallest headroom over all ranks does not yet."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def unavailable_reason(self):
        return None

    def admit(self, nbytes: int):
        return True, ""
