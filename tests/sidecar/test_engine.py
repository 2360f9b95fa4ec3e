from __future__ import annotations

from pathlib import Path

import pytest
from promptlb.sidecar import EngineMetricsError, EngineReading, parse_engine_metrics
from promptlb.sidecar._engine import END_COUNTER_WINDOW_S, TokenRate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-metrics"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # 7,281 blocks of 16 tokens, from vllm:cache_config_info's labels.
        ("vllm-v0.txt", EngineReading("vllm", 0, 0, 0.0, 7.0, 116_496)),
        ("vllm-v1.txt", EngineReading("vllm", 0, 0, 0.0, 0.0)),
        ("tgi.txt", EngineReading("tgi", 0, 0, None, None)),
        ("llamacpp.txt", EngineReading("llamacpp", 0, 0, 0.491063, 3469.0)),
        # SGLang's own throughput gauge, beside the counter that moves as requests end.
        (
            "sglang.txt",
            EngineReading("sglang", 162, 2826, 0.28, 7557572.0, tps=86.50814177726902),
        ),
    ],
)
def test_published_metrics_are_read_by_auto_detection(name: str, expected: EngineReading) -> None:
    assert parse_engine_metrics(fixture(name)) == expected


@pytest.mark.parametrize("name", ["vllm-v0.txt", "tgi.txt", "llamacpp.txt", "sglang.txt"])
def test_an_explicit_engine_gives_the_same_reading(name: str) -> None:
    auto = parse_engine_metrics(fixture(name))
    assert parse_engine_metrics(fixture(name), auto.engine) == auto


def test_the_wrong_explicit_engine_finds_nothing() -> None:
    with pytest.raises(EngineMetricsError, match="no running gauge"):
        parse_engine_metrics(fixture("tgi.txt"), "vllm")


@pytest.mark.parametrize("name", ["triton.txt", "triton-trtllm.txt"])
def test_unsupported_engines_are_reported_not_guessed(name: str) -> None:
    with pytest.raises(EngineMetricsError, match="no load metrics of a known engine"):
        parse_engine_metrics(fixture(name))


def test_v1_created_gauges_do_not_count_as_tokens() -> None:
    # vllm:generation_tokens_created is a unix timestamp: a prefix match would read it as tokens.
    text = fixture("vllm-v1.txt")
    assert "vllm:generation_tokens_created" in text
    assert parse_engine_metrics(text).tokens_total == 0.0


@pytest.mark.parametrize(
    "counter",
    [
        "sglang:generation_tokens_total 10\n",  # no TYPE line: the family keeps its _total
        "# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total 10\n",
    ],
)
def test_a_token_counter_is_read_however_its_type_line_names_it(counter: str) -> None:
    reading = parse_engine_metrics("sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n" + counter)
    assert (reading.engine, reading.tokens_total) == ("sglang", 10.0)


def test_an_out_of_range_throughput_gauge_is_left_out() -> None:
    load = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n"
    assert parse_engine_metrics(load + "sglang:gen_throughput -3\n").tps is None
    assert parse_engine_metrics(load + "sglang:gen_throughput 1e12\n").tps is None
    assert parse_engine_metrics(load + "sglang:gen_throughput 120\n").tps == 120.0


def test_a_per_step_counter_is_rated_over_each_interval() -> None:
    rate = TokenRate()
    assert rate.update(0.0, 100.0) is None  # the first reading
    assert rate.update(0.25, 150.0) == 200.0
    assert rate.update(0.5, 150.0) == 0.0
    assert rate.update(0.75, 10.0) is None  # the counter reset: the engine restarted
    assert rate.update(1.0, 60.0) == 200.0
    assert rate.update(1.25, 1e30) is None  # a leap no engine makes
    assert rate.update(1.5, None) is None and rate.update(1.75, 5.0) is None


def test_a_counter_that_moves_at_each_requests_end_is_rated_over_the_window() -> None:
    # Four requests at a time, each 1,000 tokens at 50 tokens/s (200 tokens/s in all): the
    # counter jumps by 1,000 as each one ends, 5 s apart on average.
    per_interval, windowed = TokenRate(), TokenRate(END_COUNTER_WINDOW_S)
    bursts, rates = [], []
    total = 0.0
    for step in range(1, 4 * 120 + 1):  # 120 s of 250 ms scrapes
        now = step * 0.25
        if step % 20 == 0:  # a request ends every 5 s
            total += 1000.0
        if (got := per_interval.update(now, total)) is not None:
            bursts.append(got)
        if (got := windowed.update(now, total)) is not None:
            rates.append((now, got))
    assert max(bursts) == 4000.0 and sum(b > 0 for b in bursts) < len(bursts) / 10
    assert rates[0][0] >= END_COUNTER_WINDOW_S  # unknown until the readings span the window
    assert all(160.0 <= r <= 240.0 for _, r in rates), rates


def test_several_engines_of_one_server_are_summed_and_kv_is_the_fullest() -> None:
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""
    assert parse_engine_metrics(text) == EngineReading("vllm", 7, 3, 0.75, None)


def test_a_label_value_holding_a_unicode_line_separator_is_one_line() -> None:
    # The format ends lines at "\n" only; a model named with U+2028 or \x85 (or a CRLF
    # exposition) must read as prometheus-client reads it.
    text = (
        "# TYPE vllm:num_requests_running gauge\r\n"
        'vllm:num_requests_running{model_name="a\u2028b\x85c"} 2.0\r\n'
        "# TYPE vllm:num_requests_waiting gauge\r\n"
        'vllm:num_requests_waiting{model_name="a\u2028b\x85c"} 1.0\r\n'
    )
    assert parse_engine_metrics(text) == EngineReading("vllm", 2, 1, None, None)


def test_the_newer_kv_name_wins_over_the_older() -> None:
    text = (
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
        "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n"
    )
    assert parse_engine_metrics(text).kv_cache == 0.1


def test_a_malformed_value_in_an_unrelated_family_does_not_spoil_the_reading() -> None:
    # Seen from a Windows llama.cpp build before its first decode; prometheus_client rejects it.
    text = fixture("llamacpp.txt") + "llamacpp:n_busy_slots_per_decode -nan(ind)\n"
    assert parse_engine_metrics(text).kv_cache == pytest.approx(0.491063)


def test_a_malformed_value_in_a_load_family_is_an_error() -> None:
    text = "llamacpp:requests_processing -nan(ind)\nllamacpp:requests_deferred 0\n"
    with pytest.raises(EngineMetricsError, match="does not parse"):
        parse_engine_metrics(text)


def test_nan_leaves_the_field_out() -> None:
    text = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\nsglang:token_usage NaN\n"
    assert parse_engine_metrics(text) == EngineReading("sglang", 1, 2, None, None)


def test_out_of_range_kv_is_clamped_and_negative_counts_are_errors() -> None:
    over = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\nsglang:token_usage 1.0000001\n"
    assert parse_engine_metrics(over).kv_cache == 1.0
    with pytest.raises(EngineMetricsError, match="running = -1"):
        parse_engine_metrics("sglang:num_running_reqs -1\nsglang:num_queue_reqs 0\n")


@pytest.mark.parametrize("text", ["", "garbage {{{\n", "\x00\xff binary", "# only comments\n"])
def test_garbage_is_an_engine_metrics_error(text: str) -> None:
    with pytest.raises(EngineMetricsError):
        parse_engine_metrics(text)


def test_two_engines_at_once_need_an_explicit_choice() -> None:
    text = fixture("tgi.txt") + fixture("sglang.txt")
    with pytest.raises(EngineMetricsError, match="several engines"):
        parse_engine_metrics(text)
    assert parse_engine_metrics(text, "sglang").running == 162


@pytest.mark.parametrize(
    "text",
    [
        "vllm:num_requests_running 1e30\nvllm:num_requests_waiting 0\n",
        "vllm:num_requests_running 0\nvllm:num_requests_waiting +Inf\n",
        # Each sample is in range; their sum is not.
        'vllm:num_requests_running{engine="0"} 9e15\nvllm:num_requests_running{engine="1"} 9e15\n'
        "vllm:num_requests_waiting 0\n",
    ],
    ids=["1e30", "inf", "summed"],
)
def test_counts_beyond_2_53_are_engine_metrics_errors(text: str) -> None:
    with pytest.raises(EngineMetricsError, match=r"outside 0\.\.2\*\*53"):
        parse_engine_metrics(text)


def test_a_count_of_exactly_2_53_is_read() -> None:
    text = f"vllm:num_requests_running {2**53}\nvllm:num_requests_waiting 0\n"
    assert parse_engine_metrics(text).running == 2**53


def test_an_infinite_token_counter_is_left_out() -> None:
    text = (
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
        "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total +Inf\n"
    )
    assert parse_engine_metrics(text) == EngineReading("vllm", 1, 0, None, None)
    finite = text.replace("+Inf", "12")
    assert parse_engine_metrics(finite) == EngineReading("vllm", 1, 0, None, 12.0)


def test_kv_capacity_is_blocks_times_block_size_as_vllm_totals_it_over_engines() -> None:
    """vLLM V1 sums its data-parallel engines' blocks at startup, and each engine's label of
    cache_config_info repeats that total: summed again, two engines of 1,000 blocks read as
    64,000 tokens, not 32,000."""
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2000"} 1.0
"""
    reading = parse_engine_metrics(text)
    assert reading.kv_tokens == 2000 * 16 and reading.running == 3


def test_sglang_schedulers_of_one_group_are_one_batch_and_groups_add_up() -> None:
    """With --enable-metrics-for-all-schedulers every tensor-parallel rank writes its group's
    batch: a TP=4 node read four times as loaded. Data-parallel ranks are batches of their
    own, and add up."""
    ranks = [
        f'dp_rank="{dp}",tp_rank="{tp}",pp_rank="0",moe_ep_rank="{tp}"'  # (expert parallel)
        for dp in (0, 1)
        for tp in range(4)
    ]
    lines = ["# TYPE sglang:num_running_reqs gauge"]
    lines += [f"sglang:num_running_reqs{{{r}}} 10" for r in ranks]
    lines += ["# TYPE sglang:num_queue_reqs gauge"]
    lines += [f"sglang:num_queue_reqs{{{r}}} 3" for r in ranks]
    lines += ["# TYPE sglang:max_total_num_tokens gauge"]
    lines += [f"sglang:max_total_num_tokens{{{r}}} 1e5" for r in ranks]
    reading = parse_engine_metrics("\n".join(lines) + "\n")
    assert (reading.running, reading.waiting, reading.kv_tokens) == (20, 6, 200_000)


@pytest.mark.parametrize(
    "labels",
    [
        'block_size="16",num_gpu_blocks="None"',  # before the engine profiled its memory
        'block_size="16",num_gpu_blocks="0"',
        'block_size="16"',
        'num_gpu_blocks="10"',
    ],
)
def test_a_capacity_the_labels_do_not_give_is_unknown(labels: str) -> None:
    text = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{{labels}}} 1.0
"""
    reading = parse_engine_metrics(text)
    assert reading.kv_tokens is None and reading.running == 0


def test_sglang_capacity_is_its_token_pool() -> None:
    text = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 161721.0
"""
    assert parse_engine_metrics(text).kv_tokens == 161_721
