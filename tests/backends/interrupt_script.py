"""Started by test_interrupt.py (not a test): start a backend, launch a long task, wait for Ctrl-C.

argv: BACKEND RUN_DIR.  Prints READY once the task's rank has written its pid file.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from hetflow.tasks.backends import get_backend
from hetflow.tasks.backends.base import LaunchSpec
from hetflow.tasks.pilot import PilotDescription
from hetflow.tasks.scheduler import RankSlot


def main(name: str, run_dir: Path) -> None:
    # As in a terminal: a background job started by a non-interactive shell (CI) inherits
    # SIGINT ignored, and Python would then never raise KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pilot = PilotDescription(name="interrupt", backend=name, cores_per_node=2, gpus_per_node=0,  # type: ignore[arg-type]
                             memory_per_node=2**33)
    backend = get_backend(name)(pilot, run_dir)
    backend.start()
    work = run_dir / "task"
    work.mkdir(mode=0o700)
    # the pid file appears whole (written aside, then renamed): the test reads it as soon as it is there
    program = "import os, sys, time; r = os.environ['PMI_RANK']; tmp = f'{sys.argv[1]}/.pid-{r}'; " \
              "open(tmp, 'w').write(str(os.getpid())); os.replace(tmp, f'{sys.argv[1]}/pid-{r}'); time.sleep(600)"
    future = backend.launch(LaunchSpec(task_id="long/1", argv=(sys.executable, "-c", program, str(work)),
                                       slots=(RankSlot(0, (0,)), RankSlot(0, (1,))), cwd=work))
    deadline = time.monotonic() + 120
    while len(list(work.glob("pid-*"))) < 2:
        if time.monotonic() > deadline:
            raise SystemExit("the task never started")
        time.sleep(0.1)
    print("READY", flush=True)
    future.result()  # until interrupted; no shutdown() on purpose


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
