#!/usr/bin/env bash
# Makes sure `promtool` (Debian's prometheus package) is installed: the tests check the
# metrics output and the alert rules with it. Installs without starting a Prometheus server.
set -euo pipefail
command -v promtool >/dev/null 2>&1 && exit 0
if [[ $(id -u) -ne 0 ]]; then
  echo "promtool is missing: install Debian's 'prometheus' package (needs root)" >&2
  exit 1
fi
echo "[ensure-promtool] installing Debian's prometheus package for promtool" >&2
policy=/usr/sbin/policy-rc.d
backup=""
if [[ -e $policy ]]; then backup=$(mktemp); cp -p "$policy" "$backup"; fi
printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
restore() { if [[ -n $backup ]]; then mv "$backup" "$policy"; else rm -f "$policy"; fi; }
trap restore EXIT
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends prometheus >/dev/null
fi
command -v promtool >/dev/null 2>&1 || { echo "promtool still missing after install" >&2; exit 1; }
