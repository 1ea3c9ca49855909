"""`strata replay SCRIPT.jsonl`: chat requests in order on one engine, one JSON object a line.

Each line: {"conversation": "A", "user": "...", "max_tokens": 64} plus optional "system", any
sampling field of engine/sampling.FIELDS ("temperature", "top_p", "top_k", "min_p",
"repetition_penalty", "seed"; the table's defaults and ranges), "speed_projection", "speculative" (off|lookup|draft:PATH|mtp[:PATH]; default --spec),
"save_session" (with "force": true to replace a longer saved conversation), "restore_session". Each
conversation keeps
its own history (replies included) exactly as the app does, so a script reproduces what a person did.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.text import harmony
from engine.errors import RequestError, StrataError
from engine.sampling import FIELDS, SamplingParams
from engine.api import GenerateRequest, RestoreSession, SaveSession
from engine.frontends.launch import start_engine

# A step's reply length when it names none: shorter than the engine's (sampling.FIELDS) default of
# 256, as scripts are tests and demos. Every other sampling default is the table's.
REPLAY_MAX_TOKENS = 64


def step_sampling(step: dict) -> SamplingParams:
    """A step's sampling: each engine/sampling.FIELDS name the step sets (as the field's type), the
    table's default for the others (max_tokens: REPLAY_MAX_TOKENS). The engine checks the ranges."""
    values: dict = {"max_tokens": REPLAY_MAX_TOKENS}
    for f in FIELDS:
        if step.get(f.name) is not None:
            values[f.name] = f.kind(step[f.name])
    return SamplingParams(**values)


def load_script(path: str) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise StrataError(f"cannot read script {path}: {e.strerror}") from None
    steps = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            step = json.loads(line)
        except ValueError as e:
            raise RequestError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(step, dict) or not isinstance(step.get("conversation", "default"), str):
            raise RequestError(f"{path}:{n}: each line must be an object with a 'conversation' name")
        if "user" not in step and not ({"save_session", "restore_session"} & step.keys()):
            raise RequestError(f"{path}:{n}: needs 'user' (or a save_session/restore_session)")
        steps.append(step)
    return steps


def run_script(engine, steps: list[dict], spec: str = "off"):
    """Yield one result dict per step."""
    histories: dict[str, list[dict]] = {}
    for step in steps:
        name = step.get("conversation", "default")
        out: dict = {"conversation": name, "events": []}
        if step.get("restore_session"):
            h = engine.submit(RestoreSession(step["restore_session"]))
            r = h.result()
            out["events"] += h.log_lines
            histories[name] = list(r.messages or [])
            out["restore_ms"] = r.restore_ms
            out["restored_tokens"] = r.restored_tokens
        if "user" in step:
            history = histories.setdefault(name, [])
            if step.get("system") and not history:
                history.append({"role": "system", "content": step["system"]})
            history.append({"role": "user", "content": step["user"]})
            sp = step_sampling(step)
            h = engine.submit(GenerateRequest(messages=list(history), sampling=sp, conversation=name,
                                              speed_projection=step.get("speed_projection"),
                                              speculative=str(step.get("speculative", spec))))
            r = h.result()
            # a harmony reply (gpt-oss) goes back as its final channel: its template refuses channel markers
            history.append({"role": "assistant", "content": harmony.split(r.text).content})
            out["events"] += h.log_lines
            out.update(tokens=r.tokens, text=r.text, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                       ttft_ms=r.ttft_ms, decode_tps=r.decode_tps)
            if r.speculative != "off":
                out.update(speculative=r.speculative, drafted_tokens=r.drafted_tokens,
                           accepted_tokens=r.accepted_tokens, acceptance_rate=r.acceptance_rate)
        if step.get("save_session"):
            h = engine.submit(SaveSession(step["save_session"], force=bool(step.get("force", False))))
            r = h.result()
            out.update(session_bytes=r.session_bytes, save_ms=r.save_ms)
        yield out


def cmd_replay(args) -> int:
    steps = load_script(args.script)
    engine = start_engine(args)
    for out in run_script(engine, steps, getattr(args, "spec", "off")):
        if args.json:
            print(json.dumps(out), flush=True)
        else:
            print(f"[{out['conversation']}] {out.get('text', '')}")
            print(f"  prompt {out.get('prompt_tokens')} (cached {out.get('cached_tokens')}), "
                  f"ttft {out.get('ttft_ms')} ms; " + "; ".join(out["events"]), file=sys.stderr)
    engine.stop()
    return 0
