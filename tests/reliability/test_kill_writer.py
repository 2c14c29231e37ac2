"""kill -9 of writers mid-write: every entry is complete or absent, and none a writer reported committed is lost.

Writers are real processes putting entries (small ones inline in the database, large ones in files) into one
cache folder while a reader process verifies what it sees; each is killed with SIGKILL at a random moment,
many times over. Afterwards every committed entry reads back bit-exact, no partial entry decodes, and the
orphan files a killed writer may leave (file written, row not yet) are only swept once old.
"""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvfuse.engine.store.disk import DiskTier
from kvfuse.engine.store.entry import DocKV

pytestmark = pytest.mark.heavy

WRITER = textwrap.dedent("""
    import sys, torch
    from kvfuse.engine.store.disk import DiskTier
    from kvfuse.engine.store.entry import DocKV
    folder, start, role = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def kv(i):
        g = torch.Generator().manual_seed(i)
        n = 3 if i % 3 == 0 else 600  # inline in the database, or a ~60 KB file
        return DocKV(torch.randn(2, n, 2, 6, generator=g), torch.randn(2, n, 2, 6, generator=g))
    disk = DiskTier(folder, 1 << 40)
    i = start
    while True:
        if role == "writer":
            if disk.put(f"{i:064x}", kv(i)):
                print(i, flush=True)
        else:  # reader: anything it finds must be exact
            got = disk.get(f"{i % 400:064x}")
            if got is not None:
                ref = kv(i % 400)
                assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v), i
        i += 1
""")


def _kv(i: int) -> DocKV:
    g = torch.Generator().manual_seed(i)
    n = 3 if i % 3 == 0 else 600
    return DocKV(torch.randn(2, n, 2, 6, generator=g), torch.randn(2, n, 2, 6, generator=g))


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line the process prints ("" if it exits or the time runs out first)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


def test_sigkill_mid_write_loses_nothing_committed(tmp_path, tally):
    folder = tmp_path / "kv"
    rng = random.Random(7)
    committed: set[int] = set()
    attempted: list[int] = []
    rounds = 12
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for r in range(rounds):
        start = r * 100_000
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(start), "writer"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        reader = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), "0", "reader"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        first = _first_line(writer, timeout_s=120)  # its imports take seconds (more on a busy machine)
        time.sleep(rng.uniform(0.2, 1.5))  # then it is writing continuously: killed at a random moment
        os.kill(writer.pid, signal.SIGKILL)
        out, _ = writer.communicate()
        os.kill(reader.pid, signal.SIGKILL)
        _, reader_err = reader.communicate()
        assert "AssertionError" not in reader_err, reader_err
        done = [int(x) for x in (first + out).split()]
        assert done, "the writer committed nothing before it was killed"
        committed.update(done)
        attempted += range(start, max(done) + 2)  # the committed ones plus the one in flight
    disk = DiskTier(folder, 1 << 40)
    lost = partial = 0
    for i in attempted:
        got = disk.get(f"{i:064x}")
        if got is None:
            lost += i in committed
            continue
        ref = _kv(i)
        partial += not (torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v))
    tally(None, rounds, wrong=partial, lost=lost)
    assert (lost, partial) == (0, 0)
    assert disk.corrupt == 0  # no torn entry ever became visible
    orphans = disk.orphans()
    assert len(orphans) <= rounds  # at most the one file in flight per kill
    assert disk.sweep_orphans(min_age_s=3600) == 0  # young orphans may be a live writer's: kept
    assert disk.sweep_orphans(min_age_s=0) == len(orphans) and disk.orphans() == []
    print(f"kill -9: {rounds} writers killed, {len(committed)} committed, {len(attempted)} attempted, lost {lost}, "
          f"partial {partial}, orphans {len(orphans)}")
