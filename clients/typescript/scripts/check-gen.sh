#!/bin/sh
# Fails when src/gen is not what `buf generate` makes now from ../../proto and
# proto/ (generated into a temporary folder and compared; nothing is changed).
set -eu
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
node_modules/.bin/buf generate --output "$tmp"
if diff -r "$tmp/src/gen" src/gen; then
  echo "clients/typescript/src/gen is up to date"
else
  echo "clients/typescript/src/gen is stale: run 'npm run generate' in clients/typescript" >&2
  exit 1
fi
