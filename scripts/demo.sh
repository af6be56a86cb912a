#!/usr/bin/env bash
# The main job: sets up .venv, then trains a small Flax LM on 2 local ranks with ODC + LB-Mini and
# with the collective baseline, and prints what each achieved.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m jaxodc demo --out "$ROOT/bench/out" "$@"
