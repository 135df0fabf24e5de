"""Every setting of ``python -m warmup_tools fleet``, in one validated object (a JSON file, ``WARMUP_FLEET_<FIELD>``
variables and flags: :func:`warmup_tools.common.settings.load_settings`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import check_settings, setting

#: The routing policies of ``smg launch --policy`` (smg 1.13.0) that need nothing beyond HTTP workers.
ROUTER_POLICIES: tuple[str, ...] = ("cache_aware", "round_robin", "prefix_hash", "consistent_hashing", "power_of_two",
                             "least_load", "random")

#: The policies that choose a replica from the request's text (smg's radix tree of what it routed, or a hash of
#: the prompt's head): with tenants sharing a fleet, where one tenant's request goes then follows what the others
#: sent, and the routing decision tells one tenant what another sent (docs/fleet.md, "Routing and tenants").
TEXT_ROUTER_POLICIES: tuple[str, ...] = ("cache_aware", "prefix_hash")

#: How the router reaches a replica: ``http``, its OpenAI front (smg forwards the request's body, routes
#: ``cache_aware`` on a tree of the text it routed); ``grpc``, the front's smg engine listeners (smg tokenizes and
#: templates, the replica runs inference only, and ``cache_aware`` routes on the replicas' KV events).
WORKER_PROTOCOLS: tuple[str, ...] = ("http", "grpc")


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSettings:
    """The replicas, the router in front of them, and the folders they share."""

    section: ClassVar[str] = "FLEET"

    replicas: int = setting(2, "Replicas started at once (each: tritonserver, its sidecar and its OpenAI front).",
                            ge=1, le=16)
    worker_protocol: str = setting("http", "How the router reaches each replica: http (its OpenAI front; the only "
                                           "one with trust mode) or grpc (smg's engine protocol, one listener per "
                                           "model on the front's grpc_worker_port and the next ports; cache_aware "
                                           "then routes on the replicas' KV events: docs/fleet.md, \"The gRPC "
                                           "worker protocol\").", choices=WORKER_PROTOCOLS)
    grpc_ports_per_replica: int = setting(8, "worker_protocol grpc: consecutive ports each replica of a local fleet "
                                             "gets for its listeners, the base model's first, then one per live "
                                             "adapter (the front's grpc_worker_models: an adapter beyond them gets "
                                             "no listener).", ge=1, le=64)
    policy: str = setting("cache_aware", "The router's policy (smg --policy) in open mode, and in trust mode when "
                                         "it does not route on the request's text (otherwise trust_policy).",
                          choices=ROUTER_POLICIES)
    trust_policy: str = setting("least_load", "Trust mode: the router's policy in place of one that routes on the "
                                              "request's text (cache_aware, prefix_hash), whose state is shared by "
                                              "every tenant; this one keeps no state built from any request's text "
                                              "(docs/fleet.md, \"Routing and tenants\").",
                                choices=tuple(p for p in ROUTER_POLICIES if p not in TEXT_ROUTER_POLICIES))
    cache_threshold: float = setting(0.3, "cache_aware: the share of a request's text that must match what a "
                                          "replica was sent before for the router to send it there again "
                                          "(smg --cache-threshold; below it, the replica with the least cached "
                                          "text).", ge=0, le=1)
    balance_abs_threshold: int = setting(1, "cache_aware: a request whose prefix a replica holds goes to the "
                                             "least-loaded replica instead when that replica has this many "
                                             "requests in flight more than the fleet's mean (smg "
                                             "--balance-abs-threshold; smg's default, 64, never spills on a "
                                             "small fleet: docs/fleet.md).", ge=0)
    balance_rel_threshold: float = setting(1.2, "cache_aware: the same spill also needs that replica's requests "
                                                "in flight above this multiple of the fleet's mean (smg "
                                                "--balance-rel-threshold).", ge=1)
    warmup_slice_s: int = setting(0, "cache_aware: for this many seconds after a replica becomes routable smg "
                                     "hands it one cache miss in four so that it builds a cache (smg "
                                     "--worker-warmup-secs, its own default 60). 0: off, since a replica joins "
                                     "warm (its plan's stanzas, the fleet's snapshots, the warm gate) and the "
                                     "slice would spend its first minute on other prefixes' misses (docs/fleet.md, "
                                     "\"A joiner's first minute\").", ge=0, le=3600)
    host: str = setting("127.0.0.1", "Address the router and the replicas' fronts listen on (each replica's "
                                     "tritonserver listens on the loopback: its front and sidecar are its clients).")
    port: int = setting(30000, "Port of the router's OpenAI API (0: any free port).", ge=0, le=65535)
    prometheus_port: int = setting(0, "Port of the router's Prometheus metrics (0: any free port; smg's own "
                                      "default, 29000, clashes with a second router on the host).", ge=0, le=65535)
    work_dir: Path | None = setting(None, "Folder of the fleet's logs, and of its control and snapshot folders "
                                          "when those are not given; empty: a new temporary folder.")
    control_dir: Path | None = setting(None, "Control folder every replica shares (desired adapters, the live "
                                             "plan, each replica's coverage reports); empty: <work_dir>/control.")
    snapshot_dir: Path | None = setting(None, "KV snapshot folder every replica shares: a new replica restores "
                                              "from it, a leaving one writes to it; empty: <work_dir>/snapshots.")
    request_log_dir: Path | None = setting(None, "Request log folder every replica shares, one subfolder per "
                                                 "replica (<replica_name>/requests-<instance>.jsonl): the planner "
                                                 "and the re-plan read them all, and a plan on trial on one replica "
                                                 "is judged against the others' (the sidecar's fleet_log_dir); "
                                                 "empty: <work_dir>/requests.")
    sidecar_config: Path | None = setting(None, "JSON file of sidecar settings (SidecarConfig fields) every "
                                                "replica's sidecar reads (its --sidecar-config); the folders and "
                                                "ports the fleet gives each replica override it; empty: the "
                                                "sidecar's defaults.")
    secrets_dir: Path | None = setting(None, "Trust mode: the deployment's secrets folder (made by `warmup_tools "
                                             "deploy-secrets`). Every replica reads its deployment secret, tenant "
                                             "keys and probe tenant's key from it, the router's worker API takes its "
                                             "router_control.key, and each replica's membership reads the replica's "
                                             "/v1/models with the probe tenant's key; empty: open mode.")
    control_key_file: Path | None = setting(None, "The router's control-plane key without trust mode: a file holding "
                                                  "one key (deploy-secrets' router_control.key). The router's worker "
                                                  "API (/workers) then answers 401 to a call without it and each "
                                                  "join sends it, while the replicas stay open mode (the gRPC "
                                                  "variants: docker-compose.grpc.yml, deploy/k8s-grpc). Empty: "
                                                  "secrets_dir's router_control.key in trust mode; with "
                                                  "worker_protocol grpc `fleet` makes one per run in its work "
                                                  "folder; otherwise the worker API is open.")
    model_repository: Path | None = setting(None, "The model repository every replica serves; empty: the "
                                                  "package's model_repository/.")
    assets_dir: Path | None = setting(None, "The LM, embedder and adapters (WARMUP_ASSETS_DIR); empty: .assets/.")
    lm_threads: int = setting(1, "torch threads of each replica's lora_adapter (0: torch's default): one per "
                                 "replica keeps replicas on a small machine from fighting over cores.", ge=0, le=256)
    warm_timeout_s: float = setting(900.0, "The longest wait for a replica's /health to say warm before the fleet "
                                           "gives up on it.", gt=0)
    health_check_interval_s: int = setting(2, "Seconds between the router's probes of each replica's /health (a "
                                              "replica that stops being warm leaves rotation).", ge=1, le=300)
    router_shutdown_grace_s: float = setting(400.0, "The longest the router waits at SIGTERM for the requests it "
                                                    "forwards to finish (smg --shutdown-grace-period-secs).",
                                             ge=0, le=3600)
    membership_interval_s: float = setting(2.0, "Seconds between two looks of a replica's membership at its /v1/models "
                                                "and the router's workers: a worker added for an adapter made live, "
                                                "removed for one retired, added again after a router restart (within "
                                                "this of the router answering: three small GETs a look; also "
                                                "`join --interval-s`).", gt=0, le=3600)
    drain_grace_s: float = setting(0.0, "A replica's drain_grace_s: the fleet takes a replica out of the router "
                                        "before it sends SIGTERM, so none is needed.", ge=0, le=600)
    stop_timeout_s: float = setting(600.0, "The longest wait for a replica to drain, write its snapshot and exit "
                                           "after SIGTERM before it is killed.", gt=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.port and self.port == self.prometheus_port:
            raise ConfigError("port and prometheus_port must differ")
        if self.grpc and self.secrets_dir is not None:
            raise ConfigError("worker_protocol grpc does not run with trust mode (secrets_dir): smg 1.13 passes no "
                              "tenant identity to a gRPC worker (no tenant, key or salt field reaches it), so the "
                              "replicas could not keep tenants apart; a trust-mode fleet uses worker_protocol http "
                              "(docs/fleet.md, \"smg's gRPC worker protocol\"); the router's control key alone is "
                              "control_key_file")
        if self.secrets_dir is not None and self.control_key_file is not None:
            raise ConfigError("give secrets_dir (trust mode: the router's key is its router_control.key) or "
                              "control_key_file (the router's key alone), not both")

    @property
    def grpc(self) -> bool:
        """Whether the router reaches the replicas over smg's gRPC engine protocol (``worker_protocol`` grpc)."""
        return self.worker_protocol == "grpc"

    @property
    def router_key_file(self) -> Path | None:
        """The file of the router's control-plane key: ``control_key_file``, or in trust mode ``secrets_dir``'s
        ``router_control.key``; None: the router's worker API is open. The router's launcher and every join read
        the key from it (never from a command line)."""
        if self.control_key_file is not None:
            return self.control_key_file
        if self.secrets_dir is not None:
            return DeploymentSecrets(self.secrets_dir).router_key
        return None

    @property
    def kv_index(self) -> str | None:
        """smg's event-driven KV index (``--kv-index``) behind ``cache_aware`` on gRPC workers; None otherwise."""
        return "positional" if self.grpc and self.routed_policy == "cache_aware" else None

    @property
    def routed_policy(self) -> str:
        """The policy the router runs: ``policy``, except in trust mode where a policy that routes on the request's
        text gives way to ``trust_policy``."""
        if self.secrets_dir is not None and self.policy in TEXT_ROUTER_POLICIES:
            return self.trust_policy
        return self.policy
