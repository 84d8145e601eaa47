"""The options `kvsnap serve` shares with the routes: each row says, for every route taking it,
its lines of that route's usage and (when it takes a value) what a missing value needs; each
route's usage and argument splitting are built from them."""

from __future__ import annotations

import argparse

import pytest

from kvsnap.errors import UsageError
from kvsnap.integrations.common.argv import split_argv
from kvsnap.integrations.common.options import (
    PERSIST_MAX_GB,
    ROUTE_OPTIONS,
    Option,
    add_options,
    config_fields,
    route_options,
    route_usage,
)
from kvsnap.integrations.mlx_lm.launcher import USAGE as MLX_LM_USAGE
from kvsnap.integrations.vllm_mlx.launcher import USAGE as VLLM_MLX_USAGE
from kvsnap.integrations.vllm_mlx.launcher import split_persist_argv

ROUTES = {"vllm-mlx": VLLM_MLX_USAGE, "mlx-lm": MLX_LM_USAGE}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_routes_usage_lists_the_rows_it_takes_in_order(route):
    usage = ROUTES[route]
    assert route_usage(route, ROUTE_OPTIONS) in usage
    at = [usage.index(f"\n  {option.flag}") for option in route_options(route, ROUTE_OPTIONS)]
    assert at == sorted(at) and at


def test_every_row_a_route_takes_says_what_its_value_needs():
    for option in ROUTE_OPTIONS:
        assert {route for route, _ in option.route_usage} == set(option.routes), option.flag
        if option.action != "store_true":
            assert option.needs.startswith(("a ", "an ")), option.flag
            with pytest.raises(UsageError, match=f"{option.flag} needs {option.needs}"):
                split_argv([option.flag], option.flag, option.needs)


def test_the_persist_values_are_taken_under_their_rows_names():
    found, rest = split_persist_argv(["M", "--persist-max-gb", "3", "--persist-requests"])
    assert found == {"persist_requests": True, "persist_max_gb": 3.0, "persist_flush_timeout": None}
    assert rest == ["M"]
    assert PERSIST_MAX_GB.name == "persist_max_gb"


def test_add_options_groups_and_config_fields_convert():
    rows = (
        Option(("--a",), type=int, default=1, help="a", fills="x.alpha"),
        Option(
            ("--no-b",),
            action="store_true",
            group="g",
            help="b",
            fills="x.b",
            convert=lambda value, args: not value,
        ),
        Option(("--c",), help="c", fills="y.c"),
    )
    parser = argparse.ArgumentParser()
    add_options(parser, rows)
    assert [g.title for g in parser._action_groups][-1] == "g"
    args = parser.parse_args(["--a", "2", "--no-b"])
    assert config_fields(rows, args, "x") == {"alpha": 2, "b": False}
    assert config_fields(rows, args, "y") == {"c": None}
