"""At interpreter exit no engine thread may be inside MLX.

A daemon thread that comes back from MLX (which runs with the GIL released) while the interpreter
finalizes is ended by pthread_exit, and that unwinding through MLX's C++ frames aborts the process
("terminate called without an active exception", exit 134 instead of the caller's: Ctrl-C on
`strata generate` mid-reply did it every time, as did a script exiting during the idle-time K/V
top-up). So at exit the idle-time work stops, every request still running or queued is cancelled (a
reply stops between tokens, a CPU prefill between layers) and each engine thread is given up to
EXIT_WAIT_S to be back waiting for a request."""
from __future__ import annotations

import atexit
import time
import weakref

from engine.events import cancel_everything

EXIT_WAIT_S = 10.0      # at interpreter exit, how long the engine threads get to stop their work

_ENGINES: weakref.WeakSet = weakref.WeakSet()


def watch(engine) -> None:
    """Have `engine` brought to rest at interpreter exit."""
    _ENGINES.add(engine)


@atexit.register
def quiet_engines() -> None:
    cancel_everything()
    engines = list(_ENGINES)
    for engine in engines:
        engine.scheduler.idle_allowed = False
    deadline = time.monotonic() + EXIT_WAIT_S
    for engine in engines:
        if engine.has_own_thread():     # not for run_forever() on the caller's thread (the Qt app stops its own)
            engine.scheduler.idle.wait(max(0.0, deadline - time.monotonic()))
