"""metrics.py: the server's metrics parse with prometheus_client's own parser, typed, with HELP and TYPE."""
from prometheus_client.parser import text_string_to_metric_families

import metrics

SD_STATS = {"stop": "length", "prompt_tokens": 5, "new_tokens": 9, "cycles": 3, "accepted": 6, "draft_len": 4,
            "accepted_by_position": [3, 2, 1, 0]}
SMC_STATS = {"stop": "eos", "prompt_tokens": 7, "new_tokens": 4, "cycles": 2, "resamples": 1, "collapses": 0}


def families(m):
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=")
    text = body.decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def value(family, suffix="_total", **labels):
    return sum(s.value for s in family.samples if s.name == family.name + suffix and s.labels == labels)


def test_every_series_is_typed_and_documented():
    m = metrics.Metrics(slots=4, live_requests=lambda: 6)
    m.finished(SD_STATS, latency=2.0, first_text=0.5)
    found, text = families(m)
    for name, family in found.items():
        assert name.startswith("smcsd_")
        assert family.documentation
        exposed = name + "_total" if family.type == "counter" else name  # the text format adds _total to a counter
        assert f"# TYPE {exposed} {family.type}" in text
        assert f"# HELP {exposed} " in text
    assert found["smcsd_time_to_first_token_seconds"].type == "histogram"
    assert found["smcsd_time_per_output_token_seconds"].type == "histogram"
    assert found["smcsd_e2e_request_latency_seconds"].type == "histogram"
    assert found["smcsd_requests"].type == "counter"
    assert found["smcsd_requests_waiting"].type == "gauge"
    assert value(found["smcsd_requests_waiting"], "") == 2
    assert value(found["smcsd_requests_running"], "") == 4


def test_counts_add_up_exactly_per_position():
    m = metrics.Metrics(slots=2, live_requests=lambda: 0)
    m.finished(SD_STATS, latency=2.0, first_text=0.5)
    m.finished(SD_STATS, latency=1.0, first_text=None)
    m.finished(SMC_STATS, latency=3.0, first_text=1.0)
    found, _ = families(m)
    assert value(found["smcsd_requests"], stop="length") == 2
    assert value(found["smcsd_requests"], stop="eos") == 1
    assert value(found["smcsd_generation_tokens"]) == 22
    assert value(found["smcsd_spec_draft_tokens"]) == 24
    assert value(found["smcsd_spec_accepted_tokens_per_position"], position="0") == 6
    assert value(found["smcsd_spec_accepted_tokens_per_position"], position="2") == 2
    assert value(found["smcsd_smc_resamples"]) == 1
    assert value(found["smcsd_e2e_request_latency_seconds"], "_count") == 3
    assert value(found["smcsd_time_to_first_token_seconds"], "_count") == 2
    assert value(found["smcsd_time_per_output_token_seconds"], "_sum") == (2.0 - 0.5) / 8 + (3.0 - 1.0) / 3
