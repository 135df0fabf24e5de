"""Cache warm-up for LLM serving on NVIDIA Triton Inference Server."""

import os

# NOTE: gRPC's fork support (on by default in grpcio's wheels) makes fork() wait, in a pthread_atfork handler, for
# every gRPC thread of the process to come to rest. The sidecar restarts tritonserver (fork with a preexec_fn, for
# PR_SET_PDEATHSIG) exactly when a stream on a dead stub is stuck inside gRPC, so that fork waited for a stream only
# the restart would end: the sidecar hung (seen in a test, the native stack in grpc's prefork handler). No child of
# this package uses gRPC before exec, so the support is off unless the environment asks for it; set before any
# module of the package imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
