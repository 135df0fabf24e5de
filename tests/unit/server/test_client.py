"""Client helpers that need no server."""

from __future__ import annotations

from unittest import mock

from warmup_tools.server.client import GenerateParams, StreamingClient


def test_streaming_client_closes_its_channel_once():
    # tritonclient's __del__ closes again after an explicit close; under gevent that second close hung
    # Locust at exit, so the channel must be closed exactly once whatever the caller does.
    client = StreamingClient("127.0.0.1:1")
    channel_close = mock.patch.object(client._client._channel, "close", wraps=client._client._channel.close)
    with channel_close as spy:
        client.close()
        client.close()
        client._client.__del__()
    assert spy.call_count == 1


def test_generate_params_send_only_what_is_set():
    assert GenerateParams(max_tokens=None).as_json() == {}
    assert GenerateParams(max_tokens=4, adapter_id="sql", seed=3).as_json() == {
        "max_tokens": 4, "adapter_id": "sql", "seed": 3}


def test_an_error_body_reads_the_same_from_triton_and_from_the_openai_front():
    from warmup_tools.server.client import _error_text

    assert _error_text('{"error": "model not found"}') == "model not found"
    assert _error_text('{"error": {"message": "invalid tenant key", "type": "authentication_error"}}') == (
        "invalid tenant key")
    assert _error_text("<html>502</html>") == "<html>502</html>"
