"""`kvsnap serve`'s start-up checks, in process: each refusal names the flag, the value and
the fix before anything binds or loads (the end-to-end cases are in test_cli_newcomer.py,
test_flags.py and tests/store/test_conversations.py)."""

from __future__ import annotations

import re

import pytest

from kvsnap.commands.cli import build_parser
from kvsnap.commands.serve_checks import (
    chat_template_args,
    check_flags,
    persist_options,
    served_model,
)
from kvsnap.errors import KvsnapError, UsageError


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_check_flags_sets_the_served_model_and_makes_the_keys(monkeypatch):
    monkeypatch.delenv("KVSNAP_API_KEY", raising=False)
    args = serve_args("--model", "org/m", "--api-key", "k" * 16)
    auth = check_flags(args)
    assert args.model == "org/m" and auth.enabled


@pytest.mark.parametrize(
    "argv, says",
    [
        (["M", "--max-queued-requests", "-1"], "--max-queued-requests -1 must be 0 or more"),
        (["M", "--chat-template-args", "[1]"], "--chat-template-args '[1]': a JSON list"),
        (["M", "--chat-template-args", "{"], "--chat-template-args '{': not JSON"),
        (["M", "--kv-snapshots", "ftp://x/y"], "ftp"),
        (["--served-model-name", "a", "M"], "--served-model-name took a M"),
    ],
)
def test_check_flags_refuses_with_the_flag_and_the_value(argv, says):
    with pytest.raises(KvsnapError, match=re.escape(says)):
        check_flags(serve_args(*argv))


def test_chat_template_args_takes_an_object():
    assert chat_template_args('{"enable_thinking": false}') == {"enable_thinking": False}


def test_served_model_is_the_positional_or_the_flag_when_they_agree():
    assert served_model(serve_args("org/m", "--model", "org/m")) == "org/m"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--persist-requests"], "--persist-requests needs a store"),
        (
            ["--persist-requests", "--kv-snapshots", "S", "--no-request-prefix-cache"],
            "--no-request-prefix-cache keeps none",
        ),
        (["--shared-tier-budget", "3"], "--shared-tier-budget needs --shared-tier URL|DIR"),
        (["--shared-tier", "/t", "--kv-snapshots", "S"], "add --persist-requests"),
    ],
)
def test_persist_flags_that_contradict_each_other_are_usage_errors(argv, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        persist_options(serve_args("M", *argv))
