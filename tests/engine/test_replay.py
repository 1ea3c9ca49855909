"""`strata replay SCRIPT.jsonl --json` in a subprocess: the A/B/A scenario, per-line fields, sessions, bad scripts."""
from __future__ import annotations

import json

import pytest

from engine.api import Generation
from test_parking import A_SYSTEM, B_MESSAGES, ask, held, start, words
from test_sessions import cli

U1 = "Tell me the whole story of the little boat: " + words(80)
U2 = "And what did the boy find in the nets that morning?"
U3 = "How did the day end for Margaret and the boy?"
FIELDS = {"conversation": str, "tokens": list, "text": str, "prompt_tokens": int, "cached_tokens": int,
          "ttft_ms": (int, float), "decode_tps": (int, float), "events": list}


def script(tmp_path, steps) -> str:
    p = tmp_path / "script.jsonl"
    p.write_text("# A/B/A\n" + "\n".join(json.dumps(s) for s in steps) + "\n")
    return str(p)


def aba_steps(session: str | None = None) -> list[dict]:
    steps = [
        {"conversation": "A", "system": A_SYSTEM, "user": U1, "max_tokens": 16, "temperature": 0.8, "seed": 11},
        {"conversation": "A", "user": U2, "max_tokens": 16, "temperature": 0.8, "seed": 12},
        {"conversation": "B", "system": B_MESSAGES[0]["content"], "user": B_MESSAGES[1]["content"],
         "max_tokens": 8, "temperature": 0.8, "seed": 7},
        {"conversation": "A", "user": U3, "max_tokens": 16, "temperature": 0.8, "seed": 13},
    ]
    if session:
        steps[1]["save_session"] = session
        steps.append({"conversation": "A2", "restore_session": session, "user": U3, "max_tokens": 16,
                      "temperature": 0.8, "seed": 13})
    return steps


def test_replay_aba_json_lines(tiny_gguf, tmp_path):
    sess = str(tmp_path / "a2.stratasession")
    p = cli("replay", script(tmp_path, aba_steps(sess)), "--model", str(tiny_gguf), "--json")
    out = [json.loads(line) for line in p.stdout.splitlines()]
    assert [o["conversation"] for o in out] == ["A", "A", "B", "A", "A2"]
    for o in out:
        for k, t in FIELDS.items():
            assert isinstance(o[k], t), (k, o)
        assert all(isinstance(t, int) for t in o["tokens"]) and len(o["tokens"]) == (8 if o["conversation"] == "B" else 16)
        assert o["ttft_ms"] > 0 and o["decode_tps"] > 0 and o["prompt_tokens"] > o["cached_tokens"]
        assert any(e.startswith(f"{o['conversation']}: prompt {o['prompt_tokens']} (cached {o['cached_tokens']})")
                   for e in o["events"]), o["events"]
    a1, a2, b, a3, a2r = out
    h = held(Generation.from_dict(a2), 16)
    assert a2["cached_tokens"] == held(Generation.from_dict(a1), 16)
    assert a2["session_bytes"] > 0 and a2["save_ms"] > 0
    assert any(e.startswith(f"parked {h} tokens in ") and "(bytes=" in e for e in b["events"]), b["events"]
    assert b["cached_tokens"] == 0
    assert any(e.startswith(f"restored {h} tokens (moved) in ") for e in a3["events"]), a3["events"]
    assert a3["cached_tokens"] == h
    # The session saved after A's second turn, restored, gives A's third turn again, all of it cached.
    assert a2r["restored_tokens"] == h and a2r["restore_ms"] > 0
    assert any(e.startswith(f"restored {h} tokens from a2.stratasession in ") for e in a2r["events"]), a2r["events"]
    assert a2r["cached_tokens"] == h and a2r["tokens"] == a3["tokens"]
    # Token for token what A's turns give when B never happened.
    engine = start(tiny_gguf)
    try:
        msgs = [{"role": "system", "content": A_SYSTEM}]
        for user, seed, got in ((U1, 11, a1), (U2, 12, a2), (U3, 13, a3)):
            msgs.append({"role": "user", "content": user})
            r, _ = ask(engine, msgs, "A", n=16, temperature=0.8, seed=seed)
            msgs.append({"role": "assistant", "content": r.text})
            assert r.tokens == got["tokens"] and r.text == got["text"]
    finally:
        engine.stop()


def test_replay_without_parking_rereads_a(tiny_gguf, tmp_path):
    p = cli("replay", script(tmp_path, aba_steps()), "--model", str(tiny_gguf), "--json",
            "--conversation-cache-mib", "0", "--conversation-disk-mib", "0")     # neither RAM nor disk
    a1, a2, b, a3 = [json.loads(line) for line in p.stdout.splitlines()]
    assert a2["cached_tokens"] == held(Generation.from_dict(a1), 16)
    assert not any(e.startswith("parked") for e in b["events"])
    assert a3["cached_tokens"] == 0


@pytest.mark.parametrize("bad, message", [
    ('{"conversation": "A", "user": "hi"}\n{"conversation": "A", "user": "hi"\n', ":2: not JSON ("),
    ('{"conversation": "A", "max_tokens": 4}\n', ":1: needs 'user' (or a save_session/restore_session)"),
    ('["A", "hi"]\n', ":1: each line must be an object with a 'conversation' name"),
])
def test_malformed_script_exits_2_with_one_line(tiny_gguf, tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(bad)
    p = cli("replay", str(path), "--model", str(tiny_gguf), "--json", check=False)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"strata: {path}") and message in lines[0], p.stderr
