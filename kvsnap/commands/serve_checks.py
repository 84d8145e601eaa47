"""`kvsnap serve`'s start-up checks: the flags, their combinations and the paths they name,
checked before the port is bound or the model loads, each failure a KvsnapError (exit 2) naming
the flag, the value and the fix. No mlx: nothing here loads a model."""

from __future__ import annotations

import json
import logging

from kvsnap.errors import KvsnapError, StoreError, UsageError

log = logging.getLogger("kvsnap")


def served_model(args) -> str:
    """The model to serve, given as `serve MODEL` or as mlx_lm.server users type it, `serve
    --model MODEL`; a KvsnapError when neither is given, or both name different models."""
    positional, flag = args.model, args.model_flag
    if positional is None and flag is None:
        names = args.served_model_name or []
        hint = (
            f" (--served-model-name took {' '.join(names)}: it takes every name up to the next "
            f"flag, so give the model before it)"
            if len(names) > 1
            else ""
        )
        raise KvsnapError(
            "no model given; name it as `kvsnap serve ORG/NAME|DIR` or `kvsnap serve --model "
            f"ORG/NAME|DIR`{hint}"
        )
    if positional is not None and flag is not None and positional != flag:
        raise KvsnapError(
            f"two models given: {positional!r} (positional) and --model {flag!r}; give one of "
            f"the two"
        )
    return positional if positional is not None else flag


def chat_template_args(text: str) -> dict:
    """``--chat-template-args``: a JSON object, or a KvsnapError naming the flag, the value
    and the fix."""
    example = "--chat-template-args '{\"enable_thinking\": false}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvsnapError(
            f"--chat-template-args {text!r}: not JSON ({exc.msg} at character {exc.pos}); give "
            f"a JSON object, e.g. {example}"
        ) from None
    if not isinstance(value, dict):
        raise KvsnapError(
            f"--chat-template-args {text!r}: a JSON {type(value).__name__}, not an object; give "
            f"an object of template variables, e.g. {example}"
        )
    return value


def check_flags(args):
    """What the flags alone can refuse, before the port is bound: the served model (set as
    ``args.model``), the template variables, the store's scheme, the keys and the queue bound.
    Returns the ``Auth`` the keys make."""
    from kvsnap.http.guard import Auth
    from kvsnap.store.remote import check_kv_snapshots

    args.model = served_model(args)
    chat_template_args(args.chat_template_args)
    check_kv_snapshots(args.kv_snapshots)  # an unknown scheme fails before the model is resolved
    auth = Auth.from_flags(args.api_key, args.admin_api_key)
    if args.max_queued_requests < 0:
        raise KvsnapError(f"--max-queued-requests {args.max_queued_requests} must be 0 or more")
    return auth


def warn_if_open(auth, host: str) -> None:
    """A warning for a server reachable from other hosts that takes no API key."""
    from kvsnap.http.watch import is_loopback

    if not auth.enabled and not is_loopback(host):
        log.warning(
            "[kvsnap] serving on %s without API keys: anyone who can reach this port can use and "
            "clear the cache; set KVSNAP_API_KEY",
            host,
        )


def check_store(args) -> None:
    """``--kv-snapshots`` naming a file or a folder of other files, and the persistence flags
    that contradict each other, refused before the model loads."""
    from kvsnap.store.opening import check_store_folder

    if args.kv_snapshots and "://" not in args.kv_snapshots:
        # a file or another folder is refused before the model loads (store.opening's policy)
        try:
            check_store_folder(args.kv_snapshots)
        except StoreError as exc:
            raise KvsnapError(f"--kv-snapshots {args.kv_snapshots}: {exc} (or oci://…)") from None
    persist_options(args)


def persist_options(args):
    """``--persist-requests`` and its settings as ``PersistOptions``, None when off; a
    UsageError for flags that contradict each other."""
    from kvsnap.runtime.persist import options

    conflicts = []
    if args.no_request_prefix_cache:
        conflicts.append(
            "persists the request prefixes the cache keeps, and --no-request-prefix-cache keeps "
            "none"
        )
    persist = options.persist_options(
        args.persist_requests,
        args.persist_max_gb,
        args.persist_flush_timeout,
        has_store=bool(args.kv_snapshots),
        conflicts=conflicts,
    )
    tier = shared_tier_options(args, persist is not None)
    if persist is not None:
        persist.shared_tier = tier
    return persist


def shared_tier_options(args, persisting: bool):
    """``--shared-tier`` and its settings as ``TierOptions`` (checked, nothing contacted),
    None when off; a UsageError naming the flag and the fix."""
    from kvsnap.runtime.persist import options
    from kvsnap.store.tier_backends import fleet_secret_from_env, open_backend

    given = [
        (flag, value)
        for flag, value in (
            ("--shared-tier-budget", args.shared_tier_budget),
            ("--shared-tier-queue-mb", args.shared_tier_queue_mb),
        )
        if value is not None
    ]
    if not args.shared_tier:
        if given:
            raise UsageError(f"{given[0][0]} needs --shared-tier URL|DIR; add it or drop the flag")
        return None
    if not persisting:
        raise UsageError(
            "--shared-tier shares what --persist-requests writes; add --persist-requests "
            "(and --kv-snapshots DIR, the local store it writes first)"
        )
    budget = args.shared_tier_budget or options.DEFAULT_TIER_BUDGET_S
    if budget > 600:
        raise UsageError(f"--shared-tier-budget {budget:g} must be at most 600 seconds")
    fleet_secret_from_env()  # a too-short secret fails here, not at the first request
    open_backend(args.shared_tier, budget).close()
    return options.TierOptions(
        spec=args.shared_tier,
        budget_s=budget,
        queue_bytes=int((args.shared_tier_queue_mb or 1024) * 2**20),
    )


def warn_without_openblas() -> None:
    """Once mlx is loaded: on Linux without OpenBLAS, CPU matmuls are several times slower."""
    from kvsnap.blas import openblas_warning

    warning = openblas_warning()
    if warning:
        log.warning("[kvsnap] %s", warning)
