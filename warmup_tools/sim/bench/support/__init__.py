"""What the benchmarks of :mod:`warmup_tools.sim.bench` share, one definition each, grouped by concern.

The rule (``tests/unit/test_layout.py``): a module of ``warmup_tools/sim/bench/`` is a benchmark (it has a
``run()`` and is listed in ``BENCHES``, ``warmup_tools/ops/cli/bench.py``) and imports no other benchmark; what two
benchmarks share, and a benchmark's helper modules, live here, and nothing here imports a benchmark.

- :mod:`.params`: the ``run()`` parameters many benchmarks take (``LmThreads``, ``MaxTokens``, ``Seed``...).
- :mod:`.tables`: Markdown tables and percentiles, as the benchmarks print them.
- :mod:`.text`: seeded synthetic prompt text of a target token length.
- :mod:`.workload`: the real-text day of the replay benchmarks: two days of traffic, a plan from day 1, day 2
  replayed on one server, a window's figures and the floor.
- :mod:`.sending`: a request sent through the smg router or a front as a streamed completion, its answer, and a
  run's failures by reason.
- :mod:`.openai_stream`: one streamed OpenAI completion as a client sees it.
- :mod:`.servers`: helper processes (an OpenAI front beside tritonserver, a throwaway redis-server) and a
  sidecar's ``/ready``.
- :mod:`.simulated`: a replica of the simulated engine (its variables, its KV budget in a trace's blocks).
- :mod:`.latency`: the concurrency benchmarks' streams, levels, percentiles and targets.
- :mod:`.cold_start`: the cold-start report of a replay (``bench replay``, ``fleet-scale``).
- :mod:`.soak_checks`, :mod:`.soak_stack`: ``bench soak``'s checks and the stack it runs (``bench memory`` names
  processes with :func:`.soak_checks.process_role`).
- :mod:`.peer_servers`, :mod:`.peer_replay`: ``bench peer``'s two servers and its real-text replay.
"""
