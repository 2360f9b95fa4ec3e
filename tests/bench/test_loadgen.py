"""The load generator's rate accuracy against a real emulator, and the report's statistics."""

from __future__ import annotations

import argparse
import json
import math
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from promptlb.bench import _loadgen as loadgen
from promptlb.bench._endpoint import nodes_needed, run_endpoint
from promptlb.bench._loadgen import Result, chat_body, node_from_headers, prompt_text, replay
from promptlb.bench._report import FAILED_AS_S, busy_slot_seconds, load_over_time, summarize
from promptlb.bench._scenario import Arrival
from promptlb.bench._stats import jain, percentile
from promptlb.emulator import Service, start_service
from promptlb.emulator._prompt import prompt_blocks

RATE = 50.0
SECONDS = 10.0


@pytest.fixture(scope="module")
def fast_emulator() -> Iterator[Service]:
    """Answers at once, with room for every request: only the generator's timing is measured."""
    emu = start_service(
        "emulator",
        *("--model", "bench", "--ttft-ms", "5", "--tokens-per-s", "2000", "--slots", "512"),
    )
    try:
        yield emu
    finally:
        emu.stop()


def poisson(rate: float, seconds: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append(Arrival(t, "short", 20, 8))
        t += rng.expovariate(rate)
    return out


async def test_open_loop_requests_leave_at_the_traces_times_over_10_s(
    fast_emulator: Service,
) -> None:
    trace = poisson(RATE, SECONDS, seed=5)
    results = await replay(fast_emulator.url, trace, model="bench", timeout_s=10, drain_s=5)
    assert len(results) == len(trace)
    assert all(r.ok for r in results), {r.error for r in results}
    # The trace's own rate (not the nominal 50/s: a Poisson draw of ~500 events varies by ~5%)
    # against the rate the requests actually left at.
    wanted = (len(trace) - 1) / (trace[-1].at - trace[0].at)
    starts = sorted(r.start for r in results)
    achieved = (len(starts) - 1) / (starts[-1] - starts[0])
    assert achieved == pytest.approx(wanted, rel=0.10)
    # Each request on time, not only on average: open loop means no drift behind the trace. The
    # bounds tell a mechanism (a closed loop drifts by seconds over 500 requests) from a busy
    # machine's stalls; the generator's own precision is a benchmark's to report.
    lateness = [r.lateness for r in results]
    assert sum(lateness) / len(lateness) < 0.1
    assert max(lateness) < 1.0
    assert all(r.ttft is not None and 0 < r.ttft <= r.latency for r in results)
    assert {r.node for r in results} == {"?"}  # no router in front: no node header


async def test_requests_past_the_drain_limit_are_cut_and_counted(fast_emulator: Service) -> None:
    # 2000 tokens at 2000/s: one second each; the drain gives them 0.2 s.
    trace = [Arrival(0.0, "long", 10, 2000), Arrival(0.05, "long", 10, 2000)]
    results = await replay(fast_emulator.url, trace, model="bench", timeout_s=10, drain_s=0.2)
    assert [r.error for r in results] == ["unfinished", "unfinished"]
    assert all(0.1 < r.end < 0.9 for r in results)  # cut at 0.2 s, not let run their 1 s


async def test_failures_are_recorded_by_kind() -> None:
    # Nothing listens on port 9 of 127.0.0.1 (discard): every connect is refused.
    trace = [Arrival(0.0, "x", 10, 5)]
    results = await replay("http://127.0.0.1:9", trace, model="bench", timeout_s=2, drain_s=2)
    assert results[0].error == "connect"
    assert results[0].status == 0


def test_node_comes_from_promptlb_or_a_peers_upstream_header() -> None:
    upstreams = {"127.0.0.1:8001": "a", "127.0.0.1:8002": "b"}
    assert node_from_headers({"x-promptlb-node": "n1"}, upstreams) == "n1"
    assert node_from_headers({"x-bench-upstream": "127.0.0.1:8002"}, upstreams) == "b"
    # nginx lists every upstream it tried; the last one answered.
    tried = {"x-bench-upstream": "127.0.0.1:8001, 127.0.0.1:8002"}
    assert node_from_headers(tried, upstreams) == "b"
    assert node_from_headers({}, upstreams) == "?"


def test_prompt_text_is_about_four_characters_a_token() -> None:
    assert len(prompt_text(100)) == 400
    assert len(prompt_text(0)) == 4
    assert len(prompt_text(100, 12345)) == 400


def test_filler_prompts_of_a_trace_share_no_cached_prefix() -> None:
    # A scenario without prompts is routed on lengths alone in the simulator: live, a node's
    # prefix cache must not make the second long filler prompt free.
    first, second = (
        json.loads(chat_body("m", Arrival(0.0, "long", 2000, 8), i))["messages"] for i in (0, 1)
    )
    _, a = prompt_blocks(first, chat=True)
    _, b = prompt_blocks(second, chat=True)
    assert len(a) == len(b) > 100 and not set(a) & set(b)


def test_latency_and_ttft_count_from_when_the_trace_says_to_send() -> None:
    # The generator's own delay (it shares the cores) stays in the numbers: coordinated
    # omission would take it out. lateness reports it apart.
    late = Result(0, "c", 10, at=1.0, start=1.3, end=2.0)
    assert late.latency == pytest.approx(1.0) and late.lateness == pytest.approx(0.3)


async def test_a_failure_of_any_kind_is_recorded_never_a_success(
    fast_emulator: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Anything the stream raises that is not an aiohttp ClientError (a ValueError from the
    # reader, an OSError) left the request with no error: a success with no TTFT.
    def broken(data: bytes) -> bool:
        raise ValueError("Chunk too big")

    monkeypatch.setattr(loadgen, "_has_content", broken)
    trace = [Arrival(0.0, "x", 10, 5)]
    results = await replay(fast_emulator.url, trace, model="bench", timeout_s=5, drain_s=5)
    assert results[0].error == "ValueError" and not results[0].ok


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_jains_index_on_known_inputs() -> None:
    assert jain([0.5, 0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one node takes all: 1/n
    assert jain([1.0, 1.0, 0.0, 0.0]) == pytest.approx(0.5)
    # (1 + 2 + 3)^2 / (3 * (1 + 4 + 9)) = 36 / 42
    assert jain([1.0, 2.0, 3.0]) == pytest.approx(36 / 42)
    assert jain([0.0, 0.0]) == 1.0
    assert jain([]) is None


def test_busy_slot_seconds_caps_at_the_slots_and_clips_to_the_window() -> None:
    # Three requests over [0, 2] on a 2-slot node: two run, one waits; 2 slots x 2 s.
    assert busy_slot_seconds([(0, 2), (0, 2), (0, 2)], slots=2, window=10) == pytest.approx(4.0)
    # One slot: [0, 1] and [0.5, 1.5] overlap, so the slot is busy from 0 to 1.5.
    assert busy_slot_seconds([(0, 1), (0.5, 1.5)], slots=1, window=10) == pytest.approx(1.5)
    # Clipped to the window.
    assert busy_slot_seconds([(9, 12)], slots=4, window=10) == pytest.approx(1.0)
    assert busy_slot_seconds([], slots=4, window=10) == 0.0


def test_load_over_time_averages_in_flight_per_bin() -> None:
    load = load_over_time([(0.0, 1.0), (0.5, 1.0)], window=2.0, step=0.5)
    assert load == pytest.approx([1.0, 2.0, 0.0, 0.0])


def _result(i: int, node: str, start: float, end: float, error: str = "") -> Result:
    r = Result(i, "c", 10, at=start, start=start, end=end, ttft=0.1, node=node)
    r.status, r.error = (200, "") if not error else (503, error)
    return r


def test_summarize_utilisation_share_and_errors() -> None:
    results = [
        _result(0, "a", 0.0, 5.0),
        _result(1, "a", 0.0, 5.0),
        _result(2, "b", 0.0, 10.0),
        _result(3, "b", 1.0, 1.0, error="http_503"),
    ]
    summary = summarize(results, {"a": 2, "b": 1}, duration=10.0)
    # a: 2 slots busy for 5 s of 10 -> 0.5; b: 1 slot busy the whole 10 s -> 1.0
    assert summary["nodes"]["a"]["utilisation"] == pytest.approx(0.5)
    assert summary["nodes"]["b"]["utilisation"] == pytest.approx(1.0)
    assert summary["jain_utilisation"] == pytest.approx(1.5**2 / (2 * 1.25), abs=1e-4)
    assert summary["nodes"]["a"]["share"] == pytest.approx(2 / 3, abs=1e-4)
    assert summary["error_rate"] == 0.25
    assert summary["errors"] == {"http_503": 1}
    assert summary["latency_ms"]["p50"] == pytest.approx(5000.0)  # successes only
    # every request, the failure as the generator's timeout: a router failing its slowest
    # requests does not read faster than one serving them late
    assert summary["latency_with_failures_ms"]["p99"] > 0.9 * FAILED_AS_S * 1000
    # and TTFT so too, which the cache targets are judged on
    assert summary["ttft_with_failures_ms"]["p99"] > 0.9 * FAILED_AS_S * 1000
    # Three successes, all ended by t=10: 3 / 10 s; over the span (to t=10) the same.
    assert summary["throughput_rps"] == pytest.approx(0.3)
    assert summary["goodput_over_span_rps"] == pytest.approx(0.3)
    late = summarize([*results, _result(4, "a", 9.0, 20.0)], {"a": 2, "b": 1}, duration=10.0)
    assert late["throughput_rps"] == pytest.approx(0.3)  # ended after the window
    assert late["goodput_over_span_rps"] == pytest.approx(4 / 20)


def _prefix_hits(url: str) -> int:
    with urllib.request.urlopen(url + "/_emulator/stats", timeout=5) as response:
        return int(json.load(response)["prefix_cache_hit_tokens"])


def test_a_request_is_cut_off_at_its_limit_not_the_next_whole_second() -> None:
    timeout = loadgen.request_timeout(60.0)
    assert timeout.total == 60.0 and timeout.ceil_threshold >= 60.0  # aiohttp ceils above it


def test_nodes_needed_plans_for_120_percent() -> None:
    assert nodes_needed(100.0, 30.0) == 4  # 1.2 x 100 / 30 = 4
    assert nodes_needed(100.0, 40.0) == 3  # 3.0 exactly: no extra node
    assert nodes_needed(1.0, 1000.0) == 1
    assert nodes_needed(10.0, 0.0) is None


def test_endpoint_measures_each_level_and_plans(
    fast_emulator: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(
        url=fast_emulator.url + "/v1/",  # an OpenAI base URL: /v1/v1/chat/completions was 404
        model="bench",
        concurrency="1,4",
        seconds=0.5,
        max_tokens=8,
        target_rate=1000.0,
        out=str(tmp_path),
    )
    before = _prefix_hits(fast_emulator.url)
    run_endpoint(args)
    # Each request a prompt of its own: the same one every time was a prefix-cache hit after
    # the first (a real engine's too), and read fast.
    assert _prefix_hits(fast_emulator.url) == before
    (path,) = tmp_path.glob("endpoint-*.json")
    report = json.loads(path.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    assert all(lv["ok"] > 0 and lv["errors"] == {} for lv in report["levels"])
    best = report["best"]["throughput_rps"]
    assert report["plan"]["nodes"] == math.ceil(1.2 * 1000.0 / best)
    assert "endpoint(s) like this one" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("seconds", "target_rate", "wrong"),
    [
        (float("nan"), None, "--seconds"),
        (float("inf"), None, "--seconds"),
        (0.5, float("nan"), "--target-rate"),
        (0.5, float("inf"), "--target-rate"),
        (0.5, -5.0, "--target-rate"),
        (0.5, 0.0, "--target-rate"),
    ],
)
def test_endpoint_refuses_numbers_it_cannot_plan_with_before_it_runs(
    seconds: float, target_rate: float | None, wrong: str
) -> None:
    args = argparse.Namespace(
        url="http://127.0.0.1:9",
        model="m",
        concurrency="1",
        seconds=seconds,
        max_tokens=8,
        target_rate=target_rate,
        out=None,
    )
    with pytest.raises(SystemExit, match=wrong):
        run_endpoint(args)


def test_a_chunk_with_a_null_error_carries_its_first_token() -> None:
    """As the proxy and the cache read it: a server that sends "error": null on every chunk
    had no time to first token measured at all."""
    assert loadgen._has_content(b'{"choices": [{"delta": {"content": "a"}}], "error": null}')
    assert not loadgen._has_content(b'{"choices": [{"delta": {"content": "a"}}], "error": {}}')
