#!/usr/bin/env bash
# A newcomer's figures: on a fresh clone of this checkout's HEAD, the README's set-up as
# written. `make xl-mtp` (install included) with a cold pip cache, then again with the cache
# it left (the venv, store and output removed in between), the lean venv's size, then
# `make test`. Prints a Markdown table for bench/RESULTS.md. Run on an idle machine.
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/clone"
cd "$work/clone"
export PIP_CACHE_DIR="$work/pip-cache"  # empty: the first install downloads everything

timed() {  # wall seconds and peak RSS (MB) of one command; its output to a log
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" >"$work/$1-$2.log" 2>&1 ||
    { tail -30 "$work/$1-$2.log"; exit 1; }
  read -r wall rss <"$work/time"
  echo "$wall $((rss / 1024))"
}

read -r cold cold_rss < <(timed make xl-mtp)
venv_mb=$(du -sm .venv | cut -f1)
cache_mb=$(du -sm "$PIP_CACHE_DIR" 2>/dev/null | cut -f1 || echo 0)
rm -rf .venv out && find cache -mindepth 1 ! -name .gitkeep -delete
read -r warm warm_rss < <(timed make xl-mtp)
read -r tests tests_rss < <(timed make test)
summary=$(grep -E "^[0-9]+ passed|passed" "$work/make-test.log" | tail -1)

echo "| step (fresh clone, $(nproc) cores) | wall s | peak RSS MB |"
echo "|---|---|---|"
echo "| make xl-mtp, cold pip cache (install + build) | $cold | $cold_rss |"
echo "| make xl-mtp, warm pip cache (${cache_mb:-0} MB cached) | $warm | $warm_rss |"
echo "| make test (test extras + suite: $summary) | $tests | $tests_rss |"
echo
echo "lean .venv after make xl-mtp: $venv_mb MB"
