import json

from warmup_tools.sim.load.stats import read_stats_json


def test_final_locust_statistics_are_read_with_percentiles(tmp_path):
    # The shape Locust's --json-file writes: one serialized StatsEntry per name.
    entries = [
        {"name": "ttft", "method": "grpc", "num_requests": 10, "num_failures": 0, "max_response_time": 310.2,
         "response_times": {"20": 5, "30": 3, "120": 1, "310": 1}},
        {"name": "generate sql", "method": "grpc", "num_requests": 4, "num_failures": 1, "max_response_time": 90.0,
         "response_times": {"90": 3}},
    ]
    (tmp_path / "run.json").write_text(json.dumps(entries))
    stats = read_stats_json(tmp_path / "run")
    ttft = stats["ttft"]
    assert (ttft.requests, ttft.failures, ttft.max_ms) == (10, 0, 310.2)
    assert ttft.percentile(0.5) == 20 and ttft.percentile(0.8) == 30 and ttft.percentile(0.9) == 120
    assert ttft.percentile(0.99) == 310 and ttft.percentile(0.0) == 20
    assert stats["generate sql"].failures == 1
    assert read_stats_json(tmp_path / "run.json").keys() == stats.keys()
