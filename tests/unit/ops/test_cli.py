"""The CLI's benchmark flags are the keyword arguments of each benchmark module's run()."""

from __future__ import annotations

import importlib
import inspect

import pytest

from warmup_tools.ops.cli import _parser, bench_options


@pytest.mark.parametrize("name", ["kv", "caches", "replay", "load", "preload", "concurrency"])
def test_every_bench_flag_binds_to_its_run_function(name):
    args = _parser().parse_args(["bench", name])
    module = importlib.import_module(f"warmup_tools.sim.bench.{name}")
    options = bench_options(args)
    assert options, "each benchmark has flags of its own"
    inspect.signature(module.run).bind(args.assets_dir, **options)
