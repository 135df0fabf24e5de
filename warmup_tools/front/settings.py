"""Every setting of the OpenAI front, in one validated object (a JSON file, ``WARMUP_FRONT_<FIELD>`` variables
and flags: :func:`warmup_tools.common.settings.load_settings`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.limits import MAX_BODY_BYTES
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.front.admission import MAX_TENANT_BOUND

#: How the front reaches the LM: the three composing models in turn (a client that goes away cancels the
#: generation in lora_adapter) or the ``ensemble`` (one gRPC stream; Triton 2.51 does not pass the
#: cancellation on to the running step): docs/openai.md, "Cancellation".
PIPELINES: tuple[str, ...] = ("composing", "ensemble")


@dataclasses.dataclass(frozen=True, slots=True)
class FrontSettings:
    """How the front listens, where tritonserver and the sidecar are, and the bounds on what clients send
    (the keys of ``--front-config``'s JSON file; flags override them)."""

    section: ClassVar[str] = "FRONT"

    host: str = setting("127.0.0.1", "Address the OpenAI API is served on.", flag="front-host")
    port: int = setting(9000, "Port of the OpenAI API (/v1/..., /health, /metrics; 0: any free port).",
                        ge=0, le=65535, flag="front-port")
    triton_grpc_url: str = setting("127.0.0.1:8001", "tritonserver's gRPC address (host:port).")
    triton_metrics_url: str = setting("http://127.0.0.1:8002/metrics", "tritonserver's /metrics: the scheduler "
                                      "gauges and the adapter states the front reads.")
    sidecar_url: str = setting("", "The sidecar (http://host:port): /health and every request wait for its /ready; "
                                   "empty: tritonserver's own readiness.")
    model_repository: Path | None = setting(None, "The model repository tritonserver serves: the tokenizer (its "
                                                  "chat template) and the KV budget are read from its configs; "
                                                  "empty: the package's model_repository/.")
    tokenizer_path: Path | None = setting(None, "The LM tokenizer whose chat template renders messages; empty: "
                                                "tokenizer_cache's tokenizer_path in the model repository.")
    served_model_name: str = setting("base", "The name of the base model in /v1/models and in a request's "
                                             "model; every live LoRA adapter is a model under its own name.")
    pipeline: str = setting("composing", "How requests reach the LM: the composing models in turn (a client's "
                                         "disconnect reaches the engine) or the ensemble.", choices=PIPELINES)
    max_body_bytes: int = setting(MAX_BODY_BYTES, "Largest request body; a larger one is answered 413 before it is "
                                                  "read whole.", ge=1024, le=64 << 20)
    max_header_bytes: int = setting(64 << 10, "Largest request line and headers together; more is answered 431 "
                                              "and the connection closed.", ge=4096, le=1 << 20)
    head_timeout_s: float = setting(10.0, "Seconds a client may take to send a request's line and headers, from "
                                          "the connection's start or, on a kept-alive connection, from the first "
                                          "byte after an answer; then it is answered 408 and the connection "
                                          "closed.", gt=0, le=600)
    keep_alive_s: float = setting(5.0, "Seconds a kept-alive connection may stay idle between an answer and the "
                                       "next request; then it is closed (uvicorn's keep-alive timeout).",
                                  gt=0, le=3600)
    max_connections: int = setting(1024, "Connections the front holds at once; one more is answered 503 as it is "
                                         "made, before anything is read from it, and closed, so that connections "
                                         "cannot take every file descriptor.", ge=8, le=65536)
    max_messages: int = setting(256, "Messages one chat request may hold.", ge=1, le=4096)
    max_prompt_bytes: int = setting(256 << 10, "Largest prompt (a rendered conversation or a completion prompt) "
                                               "in UTF-8 bytes, as tokenizer_cache takes it; more is 413.",
                                    ge=1, le=256 << 10)
    max_stop: int = setting(4, "Stop strings one request may give (OpenAI's limit).", ge=0, le=16)
    body_timeout_s: float = setting(10.0, "Seconds a client may take to send its body; a half-sent body is "
                                          "answered 408.", gt=0)
    request_timeout_s: float = setting(600.0, "Deadline of one generation on tritonserver.", gt=0)
    poll_interval_s: float = setting(1.0, "Seconds between reads of tritonserver's /metrics and the readiness "
                                          "(what /v1/models, /metrics and the 503 answer come from).", gt=0, le=60)
    drain_grace_s: float = setting(5.0, "On SIGTERM, seconds /health answers 503 while requests are still taken, "
                                        "so that a router or load balancer takes the replica out before any "
                                        "request is refused; then new requests get 503 and those in flight "
                                        "finish (0: refuse at once, for a router that removed the replica first).",
                                   ge=0, le=600)
    drain_timeout_s: float = setting(300.0, "On SIGTERM, the longest wait for the requests in flight to finish "
                                            "before tritonserver is stopped (and writes its KV snapshot).", gt=0)
    tenant_max_in_flight: int = setting(0, "Generation requests one tenant may have in flight through this front "
                                           "(from its first call to tritonserver to the end of its answer or its "
                                           "client's leaving); one more is answered 429 rate_limit_exceeded with "
                                           "Retry-After before anything reaches tritonserver. 0: what lora_adapter "
                                           "holds for one tenant in the model repository served (max_num_seqs plus "
                                           "tenant_queue_share of max_queue, one instance).", ge=0,
                                        le=MAX_TENANT_BOUND)
    tenant_keys_file: Path | None = setting(None, "Trust mode: the tenant keys file of tokenizer_cache (hashes "
                                                  "only); a request's bearer key names its tenant. Empty: open "
                                                  "mode, the tenant comes from X-Tenant-Id or user.")
    grpc_worker_port: int = setting(0, "Port of smg's gRPC worker protocol (the VllmEngine service) for the base "
                                       "model; each live adapter gets one of the next ports (GET /grpc-workers "
                                       "lists them). 0: off. Refused in trust mode (docs/fleet.md, \"smg's gRPC "
                                       "worker protocol\").", ge=0, le=65535)
    grpc_worker_host: str = setting("127.0.0.1", "Address the gRPC worker listeners are served on: reachable by "
                                                 "the router alone (the ports carry no credential: SECURITY.md).")
    grpc_worker_models: int = setting(16, "gRPC worker listeners at most (the base model and live adapters, one "
                                          "port each from grpc_worker_port on); an adapter beyond them gets none.",
                                      ge=1, le=1024)
    kv_events_dir: Path | None = setting(None, "The folder where each lora_adapter instance serves its KV events "
                                               "(<instance>.sock); SubscribeKvEvents relays the one socket there. "
                                               "Empty: no events (SubscribeKvEvents answers UNIMPLEMENTED).")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.served_model_name or len(self.served_model_name) > 64:
            raise ConfigError("served_model_name must be 1 to 64 characters")
        if self.grpc_worker_port and self.grpc_worker_port + self.grpc_worker_models - 1 > 65535:
            raise ConfigError(f"grpc_worker_port {self.grpc_worker_port} leaves no room for grpc_worker_models "
                              f"({self.grpc_worker_models}) ports below 65536")
        if ":" not in self.triton_grpc_url:
            raise ConfigError(f"triton_grpc_url must be host:port, not {self.triton_grpc_url!r}")
