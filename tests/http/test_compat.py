"""What clients written for other servers send, on real `kvsnap serve` processes on 127.0.0.1
(issue 39): bodies without `Content-Type: application/json` (curl's `-d`), no `model` or
mlx-lm's `"default_model"`, several `--served-model-name`s, `GET /v1/models/{id}`, 404s that
name what is served, and CORS (`--allowed-origins`) answered only when asked for."""

from __future__ import annotations

import httpx
import pytest

from kvsnap.tools.serverproc import serving

KEY = "compat-tenant-key-0001"
ORIGIN = "https://app.example"
MESSAGES = [{"role": "user", "content": "hi"}]


def _serve(demo_models, tmp, name, args, env=None):
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache"), **(env or {})}
    return serving(demo_models.path("dense"), args, tmp / f"{name}.log", env=env)


@pytest.fixture(scope="module")
def open_server(demo_models, tmp_path_factory):
    """No keys, no --allowed-origins, two served names."""
    tmp = tmp_path_factory.mktemp("compat-open")
    with _serve(demo_models, tmp, "open", ["--served-model-name", "m", "team/alias"]) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_cors_server(demo_models, tmp_path_factory):
    """API keys and --allowed-origins."""
    tmp = tmp_path_factory.mktemp("compat-keyed")
    args = ["--served-model-name", "m", "--allowed-origins", ORIGIN]
    with _serve(demo_models, tmp, "keyed", args, {"KVSNAP_API_KEY": KEY}) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server(demo_models, tmp_path_factory):
    """API keys, no --allowed-origins."""
    tmp = tmp_path_factory.mktemp("compat-keyed-no-cors")
    args = ["--served-model-name", "m"]
    with _serve(demo_models, tmp, "keyed", args, {"KVSNAP_API_KEY": KEY}) as server:
        yield server


def _post(url: str, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=60)


# --- 7. bodies whatever their Content-Type ----------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "text/plain", None, "application/json"]
)
def test_regression_a_json_body_sent_as_a_form_is_parsed_not_a_500(open_server, content_type):
    """curl's `-d` sends `application/x-www-form-urlencoded`: the validation error handler
    failed to serialise the raw bytes and answered 500. The body is JSON whatever the type."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    r = _post(open_server.url, "/v1/chat/completions", body, content_type)
    assert r.status_code == 200, r.text
    r = _post(
        open_server.url, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', content_type
    )
    assert r.status_code == 200, r.text


def test_every_post_route_answers_a_form_encoded_body_with_a_4xx_never_a_500(open_server):
    """Every POST route the server has (routes added later too: read from its OpenAPI schema),
    sent curl's default content type with a body that is not JSON, and with one that is JSON
    but not the route's shape."""
    schema = httpx.get(f"{open_server.url}/openapi.json", timeout=10).json()
    posts = [path for path, ops in schema["paths"].items() if "post" in ops]
    assert "/v1/chat/completions" in posts and "/v1/completions" in posts, posts
    for path in posts:
        for body in (b"model=m&messages=hi", b'{"unexpected": [1, 2]}', b"\xff\xfe"):
            r = _post(open_server.url, path, body, "application/x-www-form-urlencoded")
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert r.json()["error"]["message"], r.text
    r = _post(open_server.url, "/v1/chat/completions", b"model=m", "text/plain")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


# --- 11. model names ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", [None, "default_model", "m", "team/alias"])
def test_a_missing_model_default_model_and_every_served_name_are_the_served_model(
    open_server, model
):
    """mlx-lm's own server tests send `"model": "default_model"` and no model at all."""
    body = {"messages": MESSAGES, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    r = httpx.post(f"{open_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "m"  # the first name answers, as vLLM's
    body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
    r = httpx.post(f"{open_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_v1_models_lists_every_served_name_and_serves_each_by_id(open_server):
    listed = httpx.get(f"{open_server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["m", "team/alias"], listed
    for name in ("m", "team/alias"):
        r = httpx.get(f"{open_server.url}/v1/models/{name}", timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == name and r.json()["object"] == "model", r.text
    r = httpx.get(f"{open_server.url}/v1/models/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "'nope'" in r.text and "'m'" in r.text and "'team/alias'" in r.text, r.text


def test_404s_name_the_path_or_model_and_what_is_served(open_server):
    r = httpx.get(f"{open_server.url}/v1/chat/complete", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    message = r.json()["error"]["message"]
    assert "/v1/chat/complete" in message and "POST /v1/chat/completions" in message, message
    body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(f"{open_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    message = r.json()["error"]["message"]
    assert "'gpt-4o'" in message and "'m'" in message and "'team/alias'" in message, message


# --- 12. CORS ----------------------------------------------------------------------------------


def _preflight(url: str, origin: str = ORIGIN) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(f"{url}/v1/chat/completions", headers=headers, timeout=10)


def test_allowed_origins_answers_the_preflight_and_marks_answers_even_with_keys(
    keyed_cors_server,
):
    url = keyed_cors_server.url
    r = _preflight(url)  # a browser's preflight carries no key
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    headers = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN, r.text
    # a refusal is readable by the page too, and still a refusal
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    other = _preflight(url, "https://evil.example")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("fixture", ["open_server", "keyed_server"])
def test_no_cors_unless_asked_for(fixture, request):
    server = request.getfixturevalue(fixture)
    r = _preflight(server.url)
    assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers
    headers = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# --- 14. tools a template never renders -------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]


def test_tools_sent_to_a_template_that_renders_none_are_warned_about_once(demo_models, tmp_path):
    """The mistral demo template reads no `tools`: requests sending tools were served in
    silence, the model never seeing them. Now the log says so, once per server start."""
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    with serving(demo_models.path("mistral"), [], tmp_path / "mistral.log", env=env) as server:
        for _ in range(3):
            body = {"model": "mistral", "messages": MESSAGES, "max_tokens": 2, "tools": TOOLS}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
    warned = [line for line in server.log().splitlines() if "renders none" in line]
    assert len(warned) == 1 and "WARNING" in warned[0], server.log()[-3000:]


def test_tools_sent_to_a_template_that_renders_them_are_not_warned_about(open_server):
    body = {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS}
    r = httpx.post(f"{open_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "renders none" not in open_server.log()
