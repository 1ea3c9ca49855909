"""Tokens/s of one process vs N ranks (MLX ring backend on 127.0.0.1), alternating rounds.

    python bench/distributed.py --ranks 2 --rounds 3 --max-tokens 32

Each round runs `strata generate --json` once as a single process and once as N ranks (pipeline, or
STRATA_DIST_MODE=tensor with --mode tensor) on the same prompt, greedy, and prints ttft and decode
tok/s medians and the ratio N-ranks / single. On one host the ranks share its CPUs, so this measures
the pipeline's overhead (hidden states and logits over TCP, one more process), not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.harness import Run, add_args   # noqa: E402


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run(n: int, args: list[str], mode: str, timeout: float = 600) -> dict:
    cmd = [sys.executable, "-m", "engine.cli", "generate", *args, "--json"]
    if n == 1:
        out = subprocess.run(cmd, cwd=REPO, env=_env({}), capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as d:
        hostfile = Path(d) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _ports(n)]))
        procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
                                            "STRATA_DIST_MODE": mode})) for r in range(n)]
        try:
            out = procs[0].communicate(timeout=timeout)[0]
            for p in procs[1:]:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mode", choices=("pipeline", "tensor"), default="pipeline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper and a storm.")
    add_args(ap)
    a = ap.parse_args()
    args = ["-p", a.prompt, "-n", str(a.max_tokens)] + (["-m", a.model] if a.model else [])
    rows: dict[int, list[dict]] = {1: [], a.ranks: []}
    for i in range(a.rounds):
        for n in ((1, a.ranks) if i % 2 == 0 else (a.ranks, 1)):   # alternate which goes first
            r = run(n, args, a.mode)
            rows[n].append(r)
            print(f"round {i + 1}, {n} rank(s): ttft {r['ttft_ms']:.0f} ms, decode {r['decode_tps']:.2f} tok/s, "
                  f"{r['generated_tokens']} tokens", file=sys.stderr)
    toks = {n: [r["tokens"] for r in rs] for n, rs in rows.items()}
    same = all(t == toks[1][0] for ts in toks.values() for t in ts)
    med = {n: (statistics.median(r["ttft_ms"] for r in rs), statistics.median(r["decode_tps"] for r in rs))
           for n, rs in rows.items()}
    print("| ranks | ttft ms (median) | decode tok/s (median) | decode vs 1 |")
    print("|---|---|---|---|")
    rec = Run(out=a.out)
    for n in (1, a.ranks):
        label = "1 (single process)" if n == 1 else f"{n} ({a.mode}, ring on 127.0.0.1)"
        print(f"| {label} | {med[n][0]:.0f} | {med[n][1]:.2f} | {med[n][1] / med[1][1]:.2f} |")
        rec.record(f"{label} ttft", med[n][0], "ms", rounds=a.rounds)
        rec.record(f"{label} decode", med[n][1], "tok/s", rounds=a.rounds)
    rec.record(f"{a.ranks} ranks decode / 1", med[a.ranks][1] / med[1][1], "x", peer="1 (single process)",
               rounds=a.rounds, same_tokens=same)
    print(f"same tokens in every run: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
