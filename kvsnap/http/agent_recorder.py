"""``serve --record-agents FILE``: every new distinct agent prefix the server answers is
appended to a warm-prompt file, ready for ``kvsnap build FILE``.

An entry is the part of the request every later request of that agent shares, in the
request's own API: ``{"name", "anthropic": {system, tools, thinking}}``,
``{"name", "responses": {instructions, leading developer/system input items, tools,
reasoning}}`` or chat's ``{"name", "messages": leading system messages, "tools"}``. Two
requests are the same agent when their prefixes convert to the same messages, tools and
template settings (so a per-request line such as Claude Code's billing hash does not make a
new entry). Tenants stay apart: an entry's name carries its key's fingerprint, and the same
prefix sent under two keys is two entries. The file is rewritten whole, atomically, at most
``max_entries`` entries long.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Optional

import xxhash

from kvsnap.agent_requests import AgentChat, anthropic_prefix, responses_prefix
from kvsnap.chat import normalize_messages
from kvsnap.errors import MessageError, WarmPromptError
from kvsnap.store.fileio import atomic_write

DEFAULT_MAX_ENTRIES = 64
RESPONSES_PREFIX_KEYS = ("instructions", "tools", "reasoning")
ANTHROPIC_PREFIX_KEYS = ("system", "tools", "thinking")

log = logging.getLogger("kvsnap.http.server")


def _no_fault(point: str) -> None:
    """The recorder's writes take no injected faults (store writes do, for the crash tests)."""


def _digest(chat: AgentChat) -> str:
    shape = [list(chat.messages), list(chat.tools or ()), chat.template_kwargs]
    return xxhash.xxh64(json.dumps(shape, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _leading_items(items: Any) -> list:
    """Input items (or chat messages) up to the first that is not a developer/system message."""
    lead = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            break
        if item.get("role") not in ("developer", "system"):
            break
        lead.append(item)
    return lead


def agent_entry(api: str, body: dict) -> Optional[tuple[str, dict]]:
    """(digest, entry without its name) of what every request like ``body`` shares; None
    when it shares nothing warmable (no system prompt, no tools)."""
    try:
        if api == "anthropic":
            prefix = {k: body[k] for k in ANTHROPIC_PREFIX_KEYS if body.get(k) is not None}
            chat, _ = anthropic_prefix(prefix, "body")
        elif api == "responses":
            prefix = {k: body[k] for k in RESPONSES_PREFIX_KEYS if body.get(k) is not None}
            prefix["input"] = _leading_items(body.get("input"))
            chat, _ = responses_prefix(prefix, "body")
        else:
            lead = _leading_items(body.get("messages"))
            if not lead:
                return None  # a chat entry is its leading system messages (and tools)
            entry = {"messages": lead, **({"tools": body["tools"]} if body.get("tools") else {})}
            messages = normalize_messages(lead)
            return _digest(
                AgentChat(tuple(messages), tuple(body.get("tools") or ()) or None)
            ), entry
    except MessageError:
        return None  # nothing every request shares (no system, no tools)
    return _digest(chat), {api: prefix}


class AgentRecorder:
    """Appends new agent prefixes to one warm-prompt file; safe from worker threads."""

    def __init__(self, path: Path, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.path = Path(path)
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries = self._read()
        self._names = {e.get("name") for e in self._entries if isinstance(e, dict)}
        self._full_logged = False

    def _read(self) -> list:
        """The file's entries (kept as they are); none when it does not exist yet."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise WarmPromptError(
                f"--record-agents {self.path}: cannot be read ({exc}); give a writable JSON "
                f"file path"
            ) from None
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as exc:
            raise WarmPromptError(
                f"--record-agents {self.path}: not valid JSON at line {exc.lineno} ({exc.msg}); "
                f"fix it or give another path (it is appended to, never overwritten)"
            ) from None
        if not isinstance(data, list):
            raise WarmPromptError(
                f"--record-agents {self.path}: the top level is a {type(data).__name__}, not a "
                f"list of warm-prompt entries; give another path"
            )
        return data

    @property
    def entries(self) -> int:
        return len(self._entries)

    def record(self, api: str, body: dict, tenant: str) -> Optional[str]:
        """Append the prefix of ``body`` (a request of ``api``: "anthropic", "responses" or
        "chat") unless the file holds it already; returns the new entry's name."""
        found = agent_entry(api, body)
        if found is None:
            return None
        digest, entry = found
        name = f"{api}-{tenant[:8] or 'open'}-{digest[:12]}"
        with self._lock:
            if name in self._names:
                return None
            if len(self._entries) >= self.max_entries:
                if not self._full_logged:
                    self._full_logged = True
                    log.warning(
                        "[kvsnap] --record-agents %s holds %d entries, its limit: no more are "
                        "recorded",
                        self.path,
                        self.max_entries,
                    )
                return None
            entries = [*self._entries, {"name": name, **entry}]
            text = json.dumps(entries, indent=1, ensure_ascii=False).encode()
            try:
                atomic_write(self.path, lambda f: f.write(text), _no_fault)
            except OSError as exc:
                # the request is answered all the same; recording is a side job
                log.warning("[kvsnap] --record-agents %s: cannot write (%s)", self.path, exc)
                return None
            self._entries = entries
            self._names.add(name)
        log.info("[kvsnap] recorded agent prefix %s in %s", name, self.path)
        return name
