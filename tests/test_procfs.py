"""Finding the processes a run started by the marker in their environment."""

from __future__ import annotations

import os
import subprocess
import uuid

from foundation.procfs import processes_with_any_variable, processes_with_variable


def test_one_look_finds_the_processes_of_any_marker_given_and_no_other():
    run = uuid.uuid4().hex
    markers = {name: f"SHEPHERD_TEST_MARK={run}-{name}" for name in ("a", "b", "c")}
    started = {
        name: subprocess.Popen(["sleep", "60"], env={**os.environ, "SHEPHERD_TEST_MARK": marker.split("=", 1)[1]})
        for name, marker in markers.items()
    }
    try:
        found = processes_with_any_variable({markers["a"].encode(), markers["c"].encode()})
        assert sorted(found) == sorted([started["a"].pid, started["c"].pid])
        assert processes_with_variable(markers["b"].encode()) == [started["b"].pid]
        # A marker is a whole NAME=value: one that only begins another's matches nothing.
        assert processes_with_any_variable({f"SHEPHERD_TEST_MARK={run}".encode()}) == []
    finally:
        for process in started.values():
            process.kill()
            process.wait()
