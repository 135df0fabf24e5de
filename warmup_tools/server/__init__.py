"""A tritonserver seen from outside: run one on the repository, and talk to it.

- ``process``: :class:`TritonServer` (start, readiness, logs, stop), explicit model control and the
  repository key, free ports.
- ``client``: the ``ensemble`` over gRPC streaming and the HTTP generate extension, metrics scraping.
- ``config``: :class:`ServeConfig` (how a command runs tritonserver), read like every settings object.
"""
