import pytest

from tests.unit.front.conftest import make_client
from warmup_tools.triton.trust import add_tenant_key

CHAT = {"model": "base", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture()
def keys(tmp_path):
    keys_file = tmp_path / "tenant_keys.json"
    key = add_tenant_key(keys_file, tmp_path / "deployment.secret", "acme")
    add_tenant_key(keys_file, tmp_path / "deployment.secret", "globex")
    return keys_file, key


def test_trust_mode_the_bearer_key_names_the_tenant_and_goes_on_as_its_key(engine, keys):
    keys_file, key = keys
    with make_client(engine, tenant_keys_file=keys_file) as client:
        response = client.post("/v1/chat/completions", json={**CHAT, "user": "globex"},
                               headers={"Authorization": f"Bearer {key}", "X-Tenant-Id": "globex"})
        assert response.status_code == 200
    assert (engine.requests[0].tenant, engine.requests[0].tenant_key) == ("acme", key)


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong-key", "Basic abc", "Bearer " + "k" * 300])
def test_trust_mode_a_missing_or_wrong_key_is_one_and_the_same_401(engine, keys, authorization):
    keys_file, key = keys
    headers = {"Authorization": authorization} if authorization is not None else {}
    with make_client(engine, tenant_keys_file=keys_file) as client:
        response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        models = client.get("/v1/models", headers=headers)
        # Naming a tenant another way does not stand in for its key: the header and `user` are open mode's.
        named = client.post("/v1/chat/completions", json={**CHAT, "user": "acme"},
                            headers={**headers, "X-Tenant-Id": "acme"})
    assert response.status_code == models.status_code == named.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert key not in response.text and "acme" not in response.text
    assert engine.requests == []


def test_open_mode_takes_any_authorization_and_the_tenant_from_the_header_or_user(client, engine):
    client.post("/v1/chat/completions", json={**CHAT, "user": "u1"}, headers={"Authorization": "Bearer anything"})
    client.post("/v1/chat/completions", json={**CHAT, "user": "u1"}, headers={"X-Tenant-Id": "t2"})
    client.post("/v1/chat/completions", json=CHAT)
    assert [r.tenant for r in engine.requests] == ["u1", "t2", None]
    assert all(r.tenant_key is None for r in engine.requests)


def test_open_mode_a_tenant_name_that_is_not_one_is_400(client):
    response = client.post("/v1/chat/completions", json={**CHAT, "user": "alice@example.com"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"
    assert client.post("/v1/chat/completions", json=CHAT, headers={"X-Tenant-Id": "../x"}).status_code == 400


def test_trust_mode_takes_the_bearer_scheme_only_and_its_key_after_any_spaces(engine, keys):
    keys_file, key = keys
    with make_client(engine, tenant_keys_file=keys_file) as client:
        spaced = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"bearer   {key} "})
        other_scheme = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Basic {key}"})
    assert spaced.status_code == 200 and other_scheme.status_code == 401
    assert [r.tenant for r in engine.requests] == ["acme"]


@pytest.mark.parametrize("where, headers, body, param", [
    ("X-Tenant-Id header", {"X-Tenant-Id": "bad name"}, {}, None),
    ("user", {}, {"user": "bad name"}, "user"),
])
def test_open_mode_names_where_a_bad_tenant_name_came_from(client, where, headers, body, param):
    response = client.post("/v1/chat/completions", json={**CHAT, **body}, headers=headers)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_tenant" and error["param"] == param
    assert error["message"] == (f"the {where} names the tenant in open mode: use 1 to 64 letters, digits, '.', '_' "
                                "or '-', starting with a letter or digit")


def test_open_mode_takes_a_tenant_name_of_the_largest_size(client, engine):
    from warmup_tools.triton.inputs import MAX_IDENTITY_BYTES

    longest = "t" * MAX_IDENTITY_BYTES
    assert client.post("/v1/chat/completions", json=CHAT, headers={"X-Tenant-Id": longest}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT,
                       headers={"X-Tenant-Id": longest + "t"}).status_code == 400
    assert engine.requests[0].tenant == longest
