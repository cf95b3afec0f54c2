"""The harness's zygote (kvbm.verify.zygote): a run that ends before its parent reads the zygote's first reply."""

from __future__ import annotations

import os
import select
import time

from kvbm.verify import zygote


def test_a_run_that_ends_before_the_parent_reads_its_pid_is_still_answered(tmp_path, monkeypatch):
    """Both reply lines ({"pid"} then {"rc"}) are in the pipe when the parent first reads: a buffered reader took
    both at once and select() then waited on the empty pipe for the second (a clean-clone run: the harness-error
    test's seed hung until its 900 s timeout)."""
    real = select.select
    calls = []

    def late_select(*a, **kw):  # the parent is slow to read (a loaded machine): the quick run has ended by then
        if not calls:
            time.sleep(2.0)
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(zygote.select, "select", late_select)
    z = zygote.Zygote(dict(os.environ), ("json",))  # a zygote that imports little: it starts in a moment
    try:
        assert z.run("json:dumps", ["1"], tmp_path / "run.log", dict(os.environ), timeout_s=10) == 0
        assert z.run("json:dumps", ["2"], tmp_path / "run2.log", dict(os.environ), timeout_s=10) == 0
    finally:
        z.close()
