"""A stream whose server is gone (a restart under way) fails with GenerateError, not tritonclient's exception."""

from __future__ import annotations

import pytest

from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient
from warmup_tools.server.process import free_port


def test_requests_on_a_stream_to_no_server_each_end_with_a_generate_error():
    with StreamingClient(f"127.0.0.1:{free_port()}", timeout_s=30) as client:
        for _ in range(2):  # the second finds the stream already failed
            with pytest.raises(GenerateError):
                client.generate("Hello", GenerateParams(max_tokens=2))
