"""Only the engine thread runs torch on several threads (``roles/torch_threads.py``): torch work on
the event loop's thread or on another thread starts no OpenMP team of its own, so the engine's
team keeps spinning between its parallel regions instead of sleeping on a futex."""

from __future__ import annotations

import json
import subprocess
import sys

# In a process of its own: the test must not change this process's torch threads.
SCRIPT = r"""
import json, os, threading, torch
from mooncake.roles.engine_thread import EngineThread
from mooncake.roles.torch_threads import build_on_engine_thread

def threads():
    return len(os.listdir("/proc/self/task"))

def work():  # one parallel region: elementwise over more elements than torch's grain size
    return float((torch.ones(1 << 22) * 2).sum())

pool = EngineThread("engine")
built, engine_threads = build_on_engine_thread(pool, 2, lambda: (work(), torch.get_num_threads())[1])
pool.submit(work).result()
out = {"built": built, "engine_threads": engine_threads, "before": threads()}
work()
out["after_this_thread"] = threads()
seen = {}
def other():
    work()
    seen["threads"], seen["torch_threads"] = threads(), torch.get_num_threads()
t = threading.Thread(target=other)
t.start()
t.join()
out["during_other_thread"], out["other_torch_threads"] = seen["threads"], seen["torch_threads"]
out["engine_after"] = pool.submit(torch.get_num_threads).result()
print(json.dumps(out))
"""


def test_torch_work_off_the_engine_thread_starts_no_team_of_its_own():
    out = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                                    check=True, timeout=120).stdout.strip().splitlines()[-1])
    assert out["built"] == 2 and out["engine_threads"] == 2 and out["engine_after"] == 2
    assert out["after_this_thread"] == out["before"]  # no OpenMP workers for this thread
    assert out["during_other_thread"] == out["before"] + 1  # the thread itself, no workers of its own
    assert out["other_torch_threads"] == 1
