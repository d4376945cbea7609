#!/usr/bin/env bash
# Refresh the dashboard's vendored front-end files from the npm registry.
# Installs exactly what package-lock.json pins (npm ci) in a scratch folder, then copies the
# built files the dashboard serves into ../static/vendor/. To move to a newer Chart.js: change
# its version in package.json, run `npm install --package-lock-only` here, then this script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
vendor="$here/../static/vendor"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$scratch/"
(cd "$scratch" && npm ci --no-audit --no-fund --silent)
cp "$scratch/node_modules/chart.js/dist/chart.umd.min.js" "$vendor/chart.umd.min.js"
cp "$scratch/node_modules/chart.js/LICENSE.md" "$vendor/chart.js.LICENSE.md"
cp "$scratch/node_modules/@kurkle/color/LICENSE.md" "$vendor/kurkle-color.LICENSE.md"
head -3 "$vendor/chart.umd.min.js"
