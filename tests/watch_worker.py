"""One process of a 2-process run for tests/test_lost_process.py: joins through `mwra.initialize_distributed`
(3 s heartbeat), starts the watchdog (`trainer.watchdog.Watchdog`), then plays its part of ``mode``:
``kill1`` -- process 1 kills itself (SIGKILL) after 1 s, process 0 waits;
``abort0`` -- as ``kill1``, and half a second after the kill a thread of process 0 aborts (libc ``abort``, as gloo's
``std::terminate`` does when a collective's peer died under it);
``finish`` -- both end normally, process 1 three seconds after process 0 and slow to leave (1.5 s between the
exit barrier and its shutdown call, as a loaded machine may be).
Usage: watch_worker.py MODE OUT_DIR PROCESS_ID PORT"""
import os
import signal
import sys
import time

import jax

from mrl_jax import mwra
from mrl_jax.trainer.watchdog import Watchdog

mode, out, me, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
info = mwra.initialize_distributed(f"localhost:{port}", 2, me, heartbeat_timeout_s=3)
Watchdog(out, info.heartbeat_timeout_s).start()   # stopped at exit
print(f"process {me} up", file=sys.stderr, flush=True)
if mode in ("kill1", "abort0") and me == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "abort0":
    import ctypes
    import threading

    time.sleep(1.5)
    threading.Thread(target=ctypes.CDLL(None).abort, daemon=True).start()
    time.sleep(60)
elif mode == "finish":
    time.sleep(3 * me)
    if me == 1:
        shutdown = jax.distributed.shutdown
        jax.distributed.shutdown = lambda: (time.sleep(1.5), shutdown())
else:
    time.sleep(60)
print(f"process {me} done", file=sys.stderr, flush=True)
