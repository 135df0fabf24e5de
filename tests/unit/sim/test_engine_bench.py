"""``bench engine`` (the GPU script's payload) runs end to end on the demo assets and counts every token."""

from __future__ import annotations

import io

from warmup_tools.sim.bench import engine as engine_bench


def test_engine_bench_measures_each_level(demo_assets):
    out = io.StringIO()
    results = engine_bench.run(demo_assets.root, levels=(1, 2), rounds=1, min_requests=2, max_tokens=3,
                               device="cpu", dtype="float32", out=out)
    assert [r.streams for r in results] == [1, 2]
    for r in results:
        assert r.errors == 0
        assert r.output_tokens == r.requests * 3
        assert len(r.ttft_ms) == r.requests and len(r.itl_ms) == r.requests * 2
    assert "8 vs 1 streams: not measured" in out.getvalue()
