#!/usr/bin/env bash
# mypy --strict on the installed package layout: tokcache (client/tokcache) with tokcache.sidecar
# (the sidecar/ folder, mapped by pyproject's package-dir) and sidecar_client. mypy reads import
# paths from folders, so this builds that layout from symlinks under build/typecheck.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TREE="$ROOT/build/typecheck"
rm -rf "$TREE"
mkdir -p "$TREE/tokcache"
for entry in "$ROOT"/client/tokcache/*; do
    ln -s "$entry" "$TREE/tokcache/$(basename "$entry")"
done
ln -s "$ROOT/sidecar" "$TREE/tokcache/sidecar"
ln -s "$ROOT/client/sidecar_client" "$TREE/sidecar_client"
cd "$TREE"
exec "${MYPY:-mypy}" --config-file "$ROOT/pyproject.toml" -p tokcache -p sidecar_client "$@"
