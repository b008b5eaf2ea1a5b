"""The reliability benchmarks, run short in ``make test-slow``: the soak (``bench/soak.py``)
and the ``cache_salt`` side-channel measurement (``bench/cache_salt.py``)."""

from __future__ import annotations

import pytest

from bench.soak import soak


@pytest.mark.slow
def test_two_minutes_of_mixed_traffic_leave_nothing_behind() -> None:
    """Mixed traffic at 80 % of the measured capacity with hang-ups, aborts and injected bad
    requests; afterwards every count adds up, the KV cache is empty, the log is clean and no
    process grew much. ``make soak`` runs 20 minutes and reports each memory slope."""
    result = soak(duration=120, load=0.8, capacity_s=30, concurrency=8, sample_s=5, seed=1)
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, (failed, result["client"], result["engine_requests"], result["log_problems"])
    client = result["client"]
    assert sum(client["succeeded"].values()) > 50, client
    assert client["aborted"].get("disconnect") and client["aborted"].get("abort"), client
    assert result["engine_requests"]["by_finish_reason"]["abort"] >= sum(client["aborted"].values())
    # Two minutes cannot show a slow leak (``make soak`` reports the slopes); a gross one
    # (a request's state kept, a cache that never evicts) shows as growth in the second half.
    grown = {role: m["growth_mib"] for role, m in result["memory"].items() if m["growth_mib"] > 96}
    assert not grown, result["memory"]


@pytest.mark.slow
def test_the_cache_salt_benchmark_sees_hits_only_under_the_tenants_own_salt() -> None:
    """``bench/cache_salt.py`` for two rounds: the times are the benchmark's to report; what
    must hold is that only the victim's own salt hits the cache."""
    from bench.cache_salt import measure

    cases = measure(rounds=2)["cases"]
    assert all(c > 1000 for c in cases["own salt"]["cached_tokens"]), cases
    for case in ("cold", "another salt", "no salt"):
        assert cases[case]["cached_tokens"] == [0, 0], cases
