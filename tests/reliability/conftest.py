"""Reliability suite fixtures: size-limited / read-only filesystems (tmpfs mounts made by the tests themselves)
and the fault table. Tiny engines come from tests/conftest.py's `tiny_engine(family="llama", **config)`.

Heavy cases carry `@pytest.mark.heavy`: the README's test command skips them; CI runs them in their own step
(`pytest -m heavy tests/reliability`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from redis_server import RedisServer, why_no_redis
from reliability_fs import CASE_OF_FILE, COLUMNS, TABLE, row, tmpfs


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Factory: mount_tmpfs(size="1m") -> Path of a fresh size-limited filesystem (unmounted afterwards)."""
    with contextlib.ExitStack() as stack:
        def factory(size: str = "1m", name: str = "fs") -> Path:
            return stack.enter_context(tmpfs(tmp_path / name, size))
        yield factory


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the session (a free localhost port, nothing persisted); skips, naming why, when
    none can be started here."""
    reason = why_no_redis()
    if reason:
        pytest.skip(reason)
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    except (OSError, RuntimeError) as e:
        pytest.skip(f"redis-server could not be started: {e}")
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own (to kill, restart or pause); skips, naming why, when none can start."""
    reason = why_no_redis()
    if reason:
        pytest.skip(reason)
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
    except (OSError, RuntimeError) as e:
        pytest.skip(f"redis-server could not be started: {e}")
    yield server
    server.kill()


# -- the fault table -------------------------------------------------------------------------------------------
# Each case row counts tries and, per try, what went wrong: wrong answers (tokens differ from the reference),
# stale serves (log-probabilities differ, or an old text's cache served), lost committed entries, code executed
# from the cache, hangs. Tests record what they measured and then assert it is zero, so a row can only show a
# non-zero count next to a failed test. A passing test that records nothing counts as one try of its file's row.
# The table is printed at the end of the run, and written as JSON to $KVFUSE_RELIABILITY_TABLE when set.
_RECORDED: set[str] = set()


@pytest.fixture
def tally(request):
    """tally(case=None, tries=1, wrong=0, stale=0, lost=0, executed=0, hangs=0): records measured outcomes."""
    default = CASE_OF_FILE.get(request.node.path.name, request.node.path.name)

    def record(case: str | None = None, tries: int = 1, wrong: int = 0, stale: int = 0, lost: int = 0,
               executed: int = 0, hangs: int = 0) -> None:
        _RECORDED.add(request.node.nodeid)
        counts = row(case or default)
        counts["tries"] += int(tries)
        for col, n in zip(COLUMNS, (wrong, stale, lost, executed, hangs)):
            counts[col] += int(n)

    return record


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and report.nodeid not in _RECORDED:
        name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
        if name in CASE_OF_FILE:
            row(CASE_OF_FILE[name])["tries"] += 1


def pytest_terminal_summary(terminalreporter):
    if not TABLE:
        return
    import json
    import os

    lines = ["| case | tries | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for case, counts in TABLE.items():
        lines.append(f"| {case} | {counts['tries']} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |")
    terminalreporter.write_sep("-", "reliability: fault table")
    for line in lines:
        terminalreporter.write_line(line)
    if os.environ.get("KVFUSE_RELIABILITY_TABLE"):
        with open(os.environ["KVFUSE_RELIABILITY_TABLE"], "w", encoding="utf-8") as f:
            json.dump(TABLE, f, indent=1)


@pytest.fixture
def reference(tiny_engine, tally):
    """`reference(question, docs, result=None)`: the answer of an engine with no disk or Redis tier (tokens and
    exact log-probabilities), computed once per prompt; with `result`, tallies how it compares."""
    from reliability_fs import compare

    ref = tiny_engine("llama")
    cache = {}

    def answer(question, docs, result=None):
        key = (question, tuple(docs))
        if key not in cache:
            cache[key] = ref.generate(question, docs, strategy="reuse", max_new_tokens=4, return_logprobs=True)
        if result is not None:
            tally(None, 1, *compare(result, cache[key]))
        return cache[key]

    return answer
