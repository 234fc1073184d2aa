"""The interpreter exits while daemon threads are inside fusedmoe calls (CPU):
the process ends cleanly (session 26's second trial: exit code 134, "terminate
called without an active exception", every time). Each case runs in a fresh
interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    import fusedmoe

    what = sys.argv[1]
    layer = fusedmoe.MoELayer.from_pretrained(sys.argv[2], layer=1, threads=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, layer.hidden_size)).astype(np.float32)
    E, H, I = 8, 64, 32
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    w2 = rng.standard_normal((E, H, I)).astype(np.float32)
    h = rng.standard_normal((512, H)).astype(np.float32)
    ids = rng.integers(0, E, (512, 2)).astype(np.int32)
    wts = rng.random((512, 2)).astype(np.float32)
    started = threading.Barrier(4)

    def loop():
        started.wait()
        while True:
            if what == "layer":
                layer(x)
            else:
                fusedmoe.fused_experts(h, w13, w2, wts, ids)

    for _ in range(3):
        threading.Thread(target=loop, daemon=True).start()
    started.wait()
    time.sleep(0.2)  # the threads are inside their calls (most of a loop's time)
    print("exiting", flush=True)
    """
)


@pytest.mark.parametrize("what", ["layer", "fused_experts"])
def test_exit_while_daemon_threads_call(what):
    for attempt in range(3):
        r = subprocess.run(
            [sys.executable, "-c", _SCRIPT, what, str(REPO / "models" / "tiny-deepseek-v3")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stdout.strip() == "exiting", (
            f"attempt {attempt}: exit code {r.returncode}, stdout {r.stdout!r}, "
            f"stderr {r.stderr[-2000:]!r}"
        )
        # No report of the daemon threads' objects as nanobind leaks either.
        assert "leaked" not in r.stderr, r.stderr[-2000:]
