"""Start N Strata processes as the ranks of one MLX distributed group on 127.0.0.1 (ring backend).

Each rank is `python -m engine.cli ...` with MLX_RANK / MLX_HOSTFILE set, as a user starts them by
hand (mlx.launch sets the same variables). Every wait is bounded and every child is killed on exit.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_hostfile(path: Path, n: int) -> Path:
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def _env(rank: int | None, hostfile: Path | None, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(k, None)
    if rank is not None:
        env["MLX_RANK"], env["MLX_HOSTFILE"] = str(rank), str(hostfile)
    env.update(extra or {})
    return env


@dataclass
class Ranks:
    procs: list = field(default_factory=list)
    logs: list = field(default_factory=list)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def log(self, rank: int) -> str:
        try:
            return Path(self.logs[rank]).read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def start_ranks(n: int, cli_args: list[str], tmp: Path, extra_env: dict | None = None) -> Ranks:
    """N ranks of `strata <cli_args>`; stdout+stderr of rank r in tmp/rank<r>.log."""
    hostfile = write_hostfile(tmp / f"hosts-{n}.json", n)
    ranks = Ranks()
    for r in range(n):
        log = tmp / f"rank{r}.log"
        ranks.logs.append(log)
        ranks.procs.append(subprocess.Popen([sys.executable, "-m", "engine.cli", *cli_args], cwd=REPO,
                                            env=_env(r, hostfile, extra_env), stdout=open(log, "wb"),
                                            stderr=subprocess.STDOUT))
    return ranks


def run_ranks(n: int, cli_args: list[str], tmp: Path, timeout: float = 90,
              extra_env: dict | None = None) -> tuple[str, Ranks]:
    """Run N ranks to completion; (rank 0's stdout+stderr, ranks). Raises on a timeout or a failed rank."""
    with start_ranks(n, cli_args, tmp, extra_env) as ranks:
        deadline = time.monotonic() + timeout
        for r, p in enumerate(ranks.procs):
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} did not finish in {timeout} s:\n" +
                                     "\n".join(f"--- rank {i}\n{ranks.log(i)[-2000:]}" for i in range(n))) from None
        for r, p in enumerate(ranks.procs):
            if p.returncode != 0:
                raise AssertionError(f"rank {r} exited {p.returncode}:\n{ranks.log(r)[-3000:]}")
        return ranks.log(0), ranks


def run_single(cli_args: list[str], timeout: float = 90) -> str:
    p = subprocess.run([sys.executable, "-m", "engine.cli", *cli_args], cwd=REPO, env=_env(None, None, None),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def json_line(text: str) -> dict:
    """The last JSON object line of a CLI output (`generate --json`)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in:\n{text[-2000:]}")
