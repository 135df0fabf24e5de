"""Trust mode against a real tritonserver: a tenant cannot be claimed without its key, and one tenant
learns nothing about another's prompts from the KV cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient
from warmup_tools.triton.trust import add_tenant_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORDS = ("invoice refund outage dashboard login password billing region revenue order customer product clause "
         "contract supplier warranty renewal quarterly report export table index latency timeout error").split()


@pytest.fixture(scope="module")
def trusted(served_assets, tmp_path_factory):
    from tests.conftest import REPO_ROOT
    from warmup_tools.server.process import TritonServer

    folder = tmp_path_factory.mktemp("trust")
    keys, secret = folder / "tenant_keys.json", folder / "deployment.secret"
    tenant_keys = {tenant: add_tenant_key(keys, secret, tenant) for tenant in ("acme", "globex", "default", "rotated")}
    server = TritonServer(
        REPO_ROOT / "model_repository",
        env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": "",
             "WARMUP_DEPLOYMENT_SECRET_FILE": str(secret), "WARMUP_TENANT_KEYS_FILE": str(keys)},
        work_dir=tmp_path_factory.mktemp("triton-trust"))
    server.start()
    try:
        server.wait_ready(timeout=600)
        server.keys_file, server.secret_file, server.assets_dir = keys, secret, served_assets
        with StreamingClient(server.grpc_url) as client:
            yield server, client, tenant_keys
        from warmup_tools.server.client import scrape_metrics

        assert sum(v for (name, _), v in scrape_metrics(server.metrics_url).items()
                   if name == "warmup_kv_cross_tenant_hits_total") == 0
    finally:
        server.stop()


def _prompt(rng):
    return "Internal memo. " + " ".join(rng.choice(WORDS) for _ in range(90)) + "\nSummarise it."


def test_a_tenant_cannot_be_claimed_without_its_key(trusted):
    _, client, keys = trusted
    for params in (GenerateParams(max_tokens=1, tenant_id="acme"),
                   GenerateParams(max_tokens=1, tenant_id="acme", tenant_key=keys["globex"]),
                   GenerateParams(max_tokens=1, tenant_id="nobody", tenant_key=keys["acme"]),
                   GenerateParams(max_tokens=1)):
        with pytest.raises(GenerateError, match="is not authenticated on this deployment"):
            client.generate("Hello", params)
    assert client.generate("Hello", GenerateParams(max_tokens=1, tenant_id="acme",
                                                   tenant_key=keys["acme"])).output_tokens == 1


def test_another_tenant_learns_nothing_from_the_kv_cache(trusted):
    _, client, keys = trusted
    acme = GenerateParams(max_tokens=1, tenant_id="acme", tenant_key=keys["acme"])
    globex = GenerateParams(max_tokens=1, tenant_id="globex", tenant_key=keys["globex"])
    rng = random.Random(7)
    secrets_of_acme = [_prompt(rng) for _ in range(50)]
    for prompt in secrets_of_acme:
        client.generate(prompt, acme)
    assert client.generate(secrets_of_acme[0], acme).cached_tokens > 0  # acme's own prompts are cached
    probes = [client.generate(p, globex) for p in secrets_of_acme]
    fresh = [client.generate(_prompt(rng), globex) for _ in range(50)]
    assert [r.cached_tokens for r in probes] == [0] * 50  # zero cross-tenant hits
    assert [r.cached_tokens for r in fresh] == [0] * 50
    # The time to first token of both, the timing side of the same question, is a figure of
    # `python -m warmup_tools bench trust`: a test must not depend on machine speed.


def test_warm_up_samples_still_warm_their_tenant(trusted):
    _, client, keys = trusted
    result = client.generate(SYSTEM_PROMPTS["support"] + "\n\nMy invoice is wrong.",
                             GenerateParams(max_tokens=1, adapter_id="support", tenant_id="default",
                                            tenant_key=keys["default"]))
    assert result.cached_tokens > 0


@pytest.mark.parametrize("model", ["embedding_cache", "lora_adapter"])
def test_calling_a_later_step_directly_cannot_choose_a_tenant(trusted, model):
    from tests.integration.test_errors import _infer_direct, _stream_direct

    server, client, keys = trusted
    claim = {"tenant_id": np.array([b"acme"], dtype=object)}
    forged = {**claim, "tenant_token": np.array([b"acme:" + b"0" * 32], dtype=object)}
    for extra in (claim, forged):
        if model == "embedding_cache":
            from tritonclient.utils import InferenceServerException

            with pytest.raises(InferenceServerException, match="this deployment verifies tenants"):
                _infer_direct(server, model, {"text_input": np.array([b"hello"], dtype=object), **extra})
        else:
            error = _stream_direct(server, model, {"input_ids": np.arange(5, 40, dtype=np.int32),
                                                   "max_tokens": np.array([1], np.int32), **extra})
            assert error is not None and "this deployment verifies tenants" in str(error)
    assert client.generate("Hello", GenerateParams(max_tokens=1, tenant_id="acme",
                                                   tenant_key=keys["acme"])).output_tokens == 1


def _token_from_tokenizer_cache(server, tenant, key):
    """What any client holding ``tenant``'s key gets by calling the first step directly."""
    from tests.integration.test_errors import _infer_direct

    result = _infer_direct(server, "tokenizer_cache", {"text_input": np.array([b"Hello there"], dtype=object),
                                                        "tenant_id": np.array([tenant.encode()], dtype=object),
                                                        "tenant_key": np.array([key.encode()], dtype=object)})
    return np.array([result.as_numpy("tenant_token").reshape(-1)[0]], dtype=object)


def test_a_token_stops_working_once_its_tenant_s_key_is_rotated(trusted):
    from tritonclient.utils import InferenceServerException

    from tests.integration.test_errors import _infer_direct, _stream_direct

    server, client, keys = trusted
    token = _token_from_tokenizer_cache(server, "rotated", keys["rotated"])
    text = {"text_input": np.array([b"hello"], dtype=object), "tenant_token": token}
    lora = {"input_ids": np.arange(5, 40, dtype=np.int32), "max_tokens": np.array([1], np.int32),
            "tenant_token": token}
    assert _infer_direct(server, "embedding_cache", text).as_numpy("embedding").shape == (384,)
    assert _stream_direct(server, "lora_adapter", lora) is None

    new_key = add_tenant_key(server.keys_file, server.secret_file, "rotated")  # no restart
    keys["rotated"] = new_key
    with pytest.raises(InferenceServerException, match="the tenant token is not valid"):
        _infer_direct(server, "embedding_cache", text)
    error = _stream_direct(server, "lora_adapter", lora)
    assert error is not None and "the tenant token is not valid" in str(error)
    # The new key works at once, through the ensemble and for a new token.
    assert client.generate("Hello", GenerateParams(max_tokens=1, tenant_id="rotated",
                                                   tenant_key=new_key)).output_tokens == 1
    fresh = _token_from_tokenizer_cache(server, "rotated", new_key)
    assert _stream_direct(server, "lora_adapter", {**lora, "tenant_token": fresh}) is None


def _own_samples(model):
    """The model's own model_warmup samples, as the bytes Triton sends at load: {name: array}."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from tests.conftest import REPO_ROOT
    from warmup_tools.triton.tensors import deserialize_tensor

    folder = REPO_ROOT / "model_repository" / model
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    samples = []
    for entry in config.model_warmup:
        sample = {}
        for name, spec in entry.inputs.items():
            sample[name] = deserialize_tensor((folder / "warmup" / spec.input_data_file).read_bytes(),
                                              model_config_pb2.DataType.Name(spec.data_type), list(spec.dims))
        samples.append(sample)
    assert samples, f"{model} has no model_warmup samples"
    return samples


def test_a_warm_up_sample_replayed_after_ready_is_an_ordinary_request(trusted):
    """Byte for byte one of the model's own samples, sent after load: no key-less tenant, no control input."""
    from tritonclient.utils import InferenceServerException

    from tests.integration.test_errors import _infer_direct, _stream_direct

    server, client, keys = trusted
    for sample in _own_samples("tokenizer_cache"):  # a sample's tenant needs its key now
        with pytest.raises(InferenceServerException, match="is not authenticated on this deployment"):
            _infer_direct(server, "tokenizer_cache", sample)
    for sample in _own_samples("embedding_cache"):
        with pytest.raises(InferenceServerException, match="'warmup_plan' is a control input"):
            _infer_direct(server, "embedding_cache", sample)
    for sample in _own_samples("lora_adapter"):
        error = _stream_direct(server, "lora_adapter", sample)
        assert error is not None and "'warmup_plan' is a control input" in str(error), error
        without_plan = {name: value for name, value in sample.items() if name != "warmup_plan"}
        error = _stream_direct(server, "lora_adapter", without_plan)
        assert error is not None and "this deployment verifies tenants" in str(error), error
    assert client.generate("Hello", GenerateParams(max_tokens=1, tenant_id="acme",
                                                   tenant_key=keys["acme"])).output_tokens == 1


def test_the_openai_front_takes_the_tenant_from_the_bearer_key(trusted, tmp_path):
    import logging

    import httpx
    import openai

    from tests.conftest import REPO_ROOT
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    server, _, tenant_keys = trusted
    settings = FrontSettings(port=0, triton_grpc_url=server.grpc_url, triton_metrics_url=server.metrics_url,
                             model_repository=REPO_ROOT / "model_repository")
    environ = {"WARMUP_ASSETS_DIR": str(server.assets_dir),
               "WARMUP_TENANT_KEYS_FILE": str(server.keys_file)}  # trust mode read from tokenizer_cache's config
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        with FrontServer(settings, environ=environ) as front:
            messages = [{"role": "system", "content": SYSTEM_PROMPTS["support"]}, {"role": "user", "content": "Hi"}]
            with openai.OpenAI(base_url=f"{front.url}/v1", api_key=tenant_keys["acme"], max_retries=0) as client:
                answer = client.chat.completions.create(model="support", messages=messages, max_tokens=2)
                assert answer.usage.completion_tokens == 2
            for key in ("wrong-key", tenant_keys["acme"][:-1]):
                with openai.OpenAI(base_url=f"{front.url}/v1", api_key=key, max_retries=0) as client:
                    with pytest.raises(openai.AuthenticationError) as refused:
                        client.chat.completions.create(model="support", messages=messages, max_tokens=2)
                    assert refused.value.body["code"] == "invalid_api_key"
            bare = httpx.post(f"{front.url}/v1/chat/completions", json={"model": "base", "messages": messages})
            assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    finally:
        logging.getLogger().removeHandler(handler)
    assert not any(tenant_keys["acme"] in handler.format(r) for r in records)
