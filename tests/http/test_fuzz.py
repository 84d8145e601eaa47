"""hypothesis over every parser a user can feed: no crash, no 500, no traceback, no changed
cache."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.chat import ROLES, normalize_messages
from kvsnap.errors import MessageError, WarmPromptError
from kvsnap.prompts import parse_warm_prompts

EXAMPLES = 1000
KEYS = [
    "role",
    "content",
    "name",
    "messages",
    "tools",
    "chat_template_kwargs",
    "type",
    "text",
    "tool_calls",
    "tool_call_id",
    "model",
    "max_tokens",
    "stream",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "prompt",
    "x",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.sampled_from(list(ROLES) + ["bot", "", "text"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(list(ROLES) + ["bot"]), "content": st.text(max_size=30) | json_values},
    optional={"name": json_values, "tool_calls": json_values},
)
message_lists = st.lists(message | json_values, max_size=4)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(
    data=json_values
    | st.lists(
        message_lists
        | st.fixed_dictionaries(
            {"messages": message_lists},
            optional={
                "name": json_values,
                "tools": json_values,
                "chat_template_kwargs": json_values,
            },
        ),
        max_size=4,
    )
)
def test_warm_prompt_parser_never_crashes(data):
    try:
        result = parse_warm_prompts(data)
    except WarmPromptError as exc:
        assert not isinstance(data, list) and "top level must be a JSON list" in str(exc)
        return
    assert len(result.entries) + len(result.problems) == len(data)
    for entry in result.entries:
        assert entry.messages and entry.messages[-1]["role"] not in ("user", "tool")
        assert all(
            isinstance(m["content"], str) and m["role"] in ROLES and m["role"] != "developer"
            for m in entry.messages
        )
    for problem in result.problems:
        assert str(problem).startswith(f"entry {problem.index}: entries[{problem.index}]")


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=message_lists | json_values)
def test_message_normaliser_accepts_or_explains(data):
    try:
        out = normalize_messages(data)
    except MessageError as exc:
        assert exc.where.startswith("messages") and exc.problem and exc.fix
        return
    assert isinstance(out, list) and out
    assert all(set(m) >= {"role", "content"} and isinstance(m["content"], str) for m in out)


@pytest.fixture(scope="module")
def app_client(demo_models, tmp_path_factory):
    from fastapi.testclient import TestClient

    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(demo_models.path("dense")), continuous_batching=True))
    app = create_app(
        engine, ServerConfig(served_model_name="m", default_max_tokens=3, context_length=32768)
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        engine.wait_warm(60)
        yield client


small_ints = (
    st.integers(-3, 3)
    | st.integers(-(2**63), 2**63)
    | st.text(max_size=3)
    | st.none()
    | st.floats()
)
request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "other", ""]) | json_values,
        "messages": message_lists | json_values,
        "max_tokens": small_ints,
        "max_completion_tokens": small_ints,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2) | json_values,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=10) | json_values,
        "seed": small_ints,
        "stream": st.booleans() | json_values,
        "tools": json_values,
        "chat_template_kwargs": json_values,
        "n": small_ints,
    },
)


def _cache(client):
    c = client.get("/v1/status").json()["cache"]
    return c["entry_count"], c["hits"], c["misses"], c["tokens_saved"]


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=request_bodies | json_values)
def test_request_schema_never_500s_and_bad_requests_never_touch_the_cache(app_client, body):
    before = _cache(app_client)
    r = app_client.post(
        "/v1/chat/completions",
        content=json.dumps(body, allow_nan=True),
        headers={"content-type": "application/json"},
    )
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert (
            set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
        )
        assert _cache(app_client) == before
    elif not (isinstance(body, dict) and body.get("stream") is True):
        assert r.json()["usage"]["completion_tokens"] <= 3
