#!/usr/bin/env bash
# Duplicate-code check: pylint's similarity checker over the package, blocks of 6+ lines.
# Prints each duplicated block with the files and lines it appears at; exit 0 only when there is none.
#   scripts/check_duplicates.sh            # pylint from PATH (pip install pylint)
#   PYLINT=/path/to/pylint scripts/check_duplicates.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYLINT=${PYLINT:-pylint}
if ! command -v "$PYLINT" >/dev/null 2>&1; then
    echo "check_duplicates: '$PYLINT' not found; pip install pylint, or set PYLINT to its path" >&2
    exit 2
fi
# astroid parses the files; nothing is imported, so mlx need not be installed.
exec "$PYLINT" --disable=all --enable=duplicate-code --min-similarity-lines=6 --score=n kvsnap "$@"
