"""`kvsnap build` warns about agent ``chat_template_kwargs`` the model's template never reads.

kvsnap serve answers 400 to a request carrying such a key, so an agents file that sets one
(README's ``enable_thinking`` on a template without it) builds snapshots no request with the
same kwargs can use. Real builds of tiny demo models: a ChatML template that reads
``enable_thinking`` and a Mistral-style one that reads nothing settable.
"""

from __future__ import annotations

import json

from helpers.cli import run_kvsnap

SYSTEM = {"role": "system", "content": "You plan the work of a small team, step by step."}


def _build(tmp_path, model, agents: list[dict], *extra: str):
    path = tmp_path / "agents.json"
    path.write_text(json.dumps(agents))
    r = run_kvsnap("build", path, "--model", model, "--out", tmp_path / "snaps", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "chat_template_kwargs" in line]


def test_a_kwarg_the_template_never_reads_is_a_warning_naming_agent_variable_and_settable(
    demo_models, tmp_path
):
    agents = [
        {
            "name": "thinker",
            "messages": [SYSTEM],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {
            "name": "effort",
            "messages": [SYSTEM],
            "chat_template_kwargs": {"reasoning_effort": "low"},
        },
    ]
    r = _build(tmp_path, demo_models.path("dense"), agents, "--json")
    json.loads(r.stdout)  # the report stays clean JSON: the warning goes to stderr
    (warning,) = _warnings(r.stderr)
    assert "'effort'" in warning and "'reasoning_effort'" in warning, warning
    assert "settable variables: enable_thinking)" in warning, warning
    assert "'thinker'" not in r.stderr and "'enable_thinking'" not in r.stderr, r.stderr


def test_readmes_enable_thinking_on_a_template_without_it_is_a_warning(demo_models, tmp_path):
    agents = [
        {
            "name": "planner",
            "messages": [SYSTEM],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    ]
    r = _build(tmp_path, demo_models.path("mistral"), agents)
    (warning,) = _warnings(r.stdout + r.stderr)
    assert "agent 'planner'" in warning and "'enable_thinking'" in warning, warning
    assert "settable variables: none" in warning and "400" in warning, warning


def test_kwargs_the_template_reads_build_without_a_warning(demo_models, tmp_path):
    agents = [
        {
            "name": "thinker",
            "messages": [SYSTEM],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {"name": "plain", "messages": [SYSTEM]},
    ]
    r = _build(tmp_path, demo_models.path("dense"), agents)
    assert _warnings(r.stdout + r.stderr) == [], r.stdout + r.stderr


def test_a_reserved_kwarg_the_template_reads_is_not_called_unread(demo_models, tmp_path):
    """The ChatML template reads ``tools``, yet the warning said it "is not a variable this
    model's chat template reads": kvsnap fills ``tools`` in itself (a request may not set it
    either), so the warning says so and where an agent's tools go."""
    from kvsnap.http.limits import template_variables

    model = demo_models.path("dense")
    assert "tools" in template_variables(demo_models.load("dense").tokenizer.chat_template)
    agents = [
        {"name": "tooled", "messages": [SYSTEM], "chat_template_kwargs": {"tools": []}},
        {"name": "plain", "messages": [SYSTEM]},
    ]
    path = tmp_path / "agents.json"
    path.write_text(json.dumps(agents))
    r = run_kvsnap("build", path, "--model", model, "--out", tmp_path / "snaps")
    (warning,) = _warnings(r.stdout + r.stderr)
    assert "agent 'tooled'" in warning and "'tools'" in warning, warning
    assert "is not a variable this model's chat template reads" not in warning, warning
    assert "filled in by kvsnap" in warning and "its own 'tools' field" in warning, warning
