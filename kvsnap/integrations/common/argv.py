"""Run another tool's ``main`` in this process as if from its own command line."""

from __future__ import annotations

import sys
from typing import Callable


def run_main(main: Callable[[], object], argv: list[str]) -> int:
    """``main()`` with ``sys.argv`` set to ``argv`` (restored after); its exit status is
    returned."""
    saved = sys.argv
    sys.argv = list(argv)
    try:
        main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
