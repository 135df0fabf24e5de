import pytest

from warmup_tools.server.client import StreamingClient


@pytest.fixture()
def grpc_client(triton):
    with StreamingClient(triton.grpc_url, timeout_s=120) as client:
        yield client
