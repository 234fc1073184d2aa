"""fork() while another thread is inside a fusedmoe call (CPU): the child's own
calls run (session 26's trial: the child hung on the lock the parent's call
held at the fork, 4 times in 5)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import fusedmoe
from conftest import REPO

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="skipped: no os.fork on this platform"),
    # Python 3.12 warns about fork() in a process with threads: that is the point here.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _wait(pid: int, seconds: float = 30.0) -> int:
    """The child's exit code; a child still running after `seconds` hung: killed, failed."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung in its fusedmoe call (> {seconds} s)")
        time.sleep(0.02)


@pytest.mark.parametrize("what", ["layer", "fused_experts"])
def test_fork_while_another_thread_calls(rng, what):
    layer = fusedmoe.MoELayer.from_pretrained(REPO / "models" / "tiny-deepseek-v3")
    H, E, k, I = layer.hidden_size, 8, 2, 48
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / H**0.5
    w2 = rng.standard_normal((E, H, I)).astype(np.float32) / I**0.5

    big = rng.standard_normal((2000, H)).astype(np.float32)
    small = np.ascontiguousarray(big[:64])
    # (no rng in the threads: NumPy's generator has a lock of its own, which a fork can catch)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(len(big))]).astype(np.int32)
    tw = np.full((len(big), k), 0.5, np.float32)

    def call(x):
        if what == "layer":
            return layer(x)
        T = x.shape[0]
        return fusedmoe.fused_experts(x, w13, w2, tw[:T], ids[:T])

    want = call(small)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            call(big)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        time.sleep(0.2)
        for _ in range(3):
            pid = os.fork()
            if pid == 0:  # the child: one call of its own, then out without cleanup
                code = 1
                try:
                    out = call(small)
                    code = 0 if np.array_equal(out, want) else 2
                finally:
                    os._exit(code)
            assert _wait(pid) == 0
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()


def test_fork_during_the_first_call_of_a_fresh_process(tmp_path):
    """A fork while another thread makes the process's first call (session 26's
    second trial: the child waited for ever on the import lock of NumPy's lazily
    imported numpy.ma, 10 times in 10)."""
    import subprocess
    import sys

    script = tmp_path / "first_call.py"
    script.write_text(f"""
import os, signal, sys, threading
import numpy as np
import fusedmoe
layer = fusedmoe.MoELayer.from_pretrained({str(REPO / "models" / "tiny-deepseek-v3")!r})
x = np.random.default_rng(0).standard_normal((64, layer.hidden_size)).astype(np.float32)
t = threading.Thread(target=lambda: layer(x))
t.start()
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    out = layer(x)
    os._exit(0 if np.isfinite(out).all() else 2)
t.join()
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
""")
    for _ in range(3):
        r = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr)  # -14: the child hung (SIGALRM)
