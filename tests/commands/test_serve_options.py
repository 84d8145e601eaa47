"""`kvsnap serve`'s options table: the docs' option tables say what it says, every row fills a
field its config object has, and the parser and the config objects are built from it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvsnap.commands.cli import build_parser
from kvsnap.commands.common import KV_OPTIONS
from kvsnap.commands.serve_options import CONFIG_OBJECTS, SERVE_OPTIONS, batch_slots
from kvsnap.integrations.common.options import config_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"
# cli.md's serve section sends readers to server.md#flags for every flag; the KV options
# build, serve and verify share are cli.md's own table.
DOC_TABLES = (("server.md", "## Flags"), ("cli.md", "## Shared KV options"))


def doc_rows() -> list[tuple[str, list[str], str]]:
    """(doc, the flags a row's first cell names, its default cell) of every option table."""
    rows = []
    for doc, heading in DOC_TABLES:
        section = (DOCS / doc).read_text().split(f"\n{heading}", 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            if not line.startswith("| `"):
                continue
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows.append((doc, re.findall(r"`(--[a-z-]+)", cells[0]), cells[1]))
    return rows


def flags_with_a_value() -> list[str]:
    return [o.flag for o in SERVE_OPTIONS if o.flag.startswith("--")]


def test_every_option_is_documented_with_the_tables_default():
    rows = doc_rows()
    problems = []
    for option in SERVE_OPTIONS:
        if not option.flag.startswith("--"):
            continue  # the positional MODEL: the --model row documents both
        own = [(doc, default) for doc, flags, default in rows if flags == [option.flag]]
        shared = [doc for doc, flags, _ in rows if option.flag in flags]
        if not shared:
            problems.append(f"{option.flag}: in no option table of docs/cli.md or docs/server.md")
        for doc, default in own:
            if default != option.doc_default:
                problems.append(
                    f"{option.flag}: docs/{doc} says {default!r}, the table {option.doc_default!r}"
                )
        if shared and not own:
            problems.append(f"{option.flag}: only in a row of several flags, with no default")
    assert not problems, "\n".join(problems)


def test_the_docs_document_no_option_the_table_lacks():
    known = set(flags_with_a_value())
    extra = {(doc, f) for doc, flags, _ in doc_rows() for f in flags if f not in known}
    assert not extra, f"documented, but not in serve_options.SERVE_OPTIONS: {sorted(extra)}"


def test_cli_md_serve_section_names_no_flag_the_table_lacks():
    text = (DOCS / "cli.md").read_text()
    section = text.split("\n## `kvsnap serve ", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"--[a-z][a-z-]+", section))
    assert named - set(flags_with_a_value()) == set()


def test_the_check_sees_a_default_that_drifted(monkeypatch):
    port = next(o for o in SERVE_OPTIONS if o.flag == "--port")
    drifted = tuple(
        dataclasses.replace(o, doc_default="8080") if o is port else o for o in SERVE_OPTIONS
    )
    monkeypatch.setattr(f"{__name__}.SERVE_OPTIONS", drifted)
    with pytest.raises(AssertionError, match="--port: docs/server.md says '8000'"):
        test_every_option_is_documented_with_the_tables_default()


def test_a_numeric_default_is_the_one_the_docs_write():
    for option in SERVE_OPTIONS:
        if isinstance(option.default, (int, float)) and re.fullmatch(r"[\d.]+", option.doc_default):
            assert float(option.doc_default) == option.default, option.flag


def config_class(name: str):
    module, _, cls = dict(CONFIG_OBJECTS)[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def test_every_row_fills_a_field_its_config_object_has():
    for option in SERVE_OPTIONS:
        if not option.fills:
            continue
        owner, _, field = option.fills.partition(".")
        cls = config_class(owner)
        names = (
            {f.name for f in dataclasses.fields(cls)}
            if dataclasses.is_dataclass(cls)
            else set(inspect.signature(cls).parameters)
        )
        assert field in names, f"{option.flag} fills {option.fills}: {cls.__name__} has no {field}"


def test_the_parser_takes_every_row_and_nothing_else():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    taken = [a.option_strings[0] if a.option_strings else a.dest for a in serve._actions]
    assert taken[1:] == [o.flag for o in SERVE_OPTIONS]  # [0]: -h


def test_config_fields_follow_the_flags():
    args = build_parser().parse_args(
        ["serve", "M", "--max-queued-requests", "3", "--no-write-back", "--kv-bits", "4"]
    )
    engine = config_fields(SERVE_OPTIONS, args, "engine")
    assert engine["write_back"] is False and engine["max_batch_size"] == 1
    assert engine["cache_memory_mb"] == 2048.0 and engine["snapshots"] is None
    server = config_fields(SERVE_OPTIONS, args, "server")
    assert server["max_inflight"] == 1 + 3 and server["request_prefix_cache"] is True
    assert server["chat_template_args"] == {} and server["allowed_origins"] == ()
    assert config_fields(KV_OPTIONS, args, "kv")["kv_bits"] == 4
    assert config_fields(KV_OPTIONS, args, "kv")["prefill_step_size"] == 512


def test_max_batch_size_counts_only_with_continuous_batching():
    assert batch_slots(SimpleNamespace(max_batch_size=5, continuous_batching=True)) == 5
    assert batch_slots(SimpleNamespace(max_batch_size=5, continuous_batching=False)) == 1
