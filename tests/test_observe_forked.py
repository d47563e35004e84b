"""A fork server's child observes the modules it imports without walking those the server imported.

Real processes: a server-like parent imports what the fork server does (pyarrow, pandas, hetflow) and a user
module beside it, marks them (:func:`hetflow.observed.mark_imported`), and forks; each child imports a helper
module from outside its folder and walks the imported modules as a rank does (:func:`hetflow.observed.in_rank`),
once the way a rank walks them and once every module, for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")

SERVER = textwrap.dedent('''
    import json, os, resource, sys
    import importlib
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from hetflow.tasks.forkserver import PRELOAD
    for name in PRELOAD:
        importlib.import_module(name)
    import pandas
    from hetflow import observed
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import kept_by_server  # a user module the server imported: still observed in each child
    observed.mark_imported()
    observed.mark_imported()  # nothing imported since: the mark stays

    def child(full):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            import helper_of_child  # imported after the fork, as a script's helper is
            if full:
                observed._Forked.last = None  # every module, as before the mark existed
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            observed.module_sources(())  # the walk itself: page faults are the copies of the pages it touched
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            found = observed.in_rank(None, ())
            names = [name for name, _ in observed.imported()]
            os.write(w, json.dumps({"found": found, "faults": faults, "names": names}).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 1 << 20):
            data += chunk
        os.waitpid(pid, 0)
        return json.loads(data)

    print(json.dumps({"marked": child(False), "full": child(True), "modules": len(sys.modules)}))
''')


def test_a_forked_rank_observes_the_same_modules_without_walking_the_servers(tmp_path: Path) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "kept_by_server.py").write_text("K = 1\n")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "helper_of_child.py").write_text("GAIN = 2.5\n")
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "server"), str(tmp_path / "helpers")],
                          capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    marked, full = result["marked"], result["full"]
    kept, helper = tmp_path / "server" / "kept_by_server.py", tmp_path / "helpers" / "helper_of_child.py"
    assert f"module {kept.resolve()}" in marked["found"] and f"module {helper.resolve()}" in marked["found"], marked
    assert f"values {helper.resolve()}" in marked["found"], marked
    def modules(found: dict[str, str]) -> dict[str, str]:  # not the states: a fork reseeds Python's random
        return {key: value for key, value in found.items() if not key.startswith("state ")}

    assert modules(marked["found"]) == modules(full["found"])  # the same observations ...
    assert {"kept_by_server", "helper_of_child"} <= set(marked["names"]), marked["names"]
    assert len(marked["names"]) < 20 < result["modules"], marked["names"]  # ... from the child's own modules
    assert marked["faults"] * 3 < full["faults"], (marked["faults"], full["faults"])  # without copying the server's pages
