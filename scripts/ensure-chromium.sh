#!/usr/bin/env bash
# Makes sure Debian's `chromium` and `chromium-driver` are installed: the console's browser
# tests (tests/it/console.rs) drive a headless Chromium through chromedriver (WebDriver).
# `fonts-dejavu-core` comes along (chromium itself depends on no font), so the screenshots the
# tests take have readable text on a fresh machine.
# Installs them with apt if missing (refreshing the package lists first if apt does not know
# the packages yet); does nothing when both are already there.
set -euo pipefail
have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }
have && exit 0
if [[ $(id -u) -ne 0 ]]; then
  echo "chromium/chromedriver are missing: install Debian's 'chromium' and 'chromium-driver' packages (needs root)" >&2
  exit 1
fi
echo "[ensure-chromium] installing Debian's chromium and chromium-driver for the browser tests" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
fi
have || { echo "chromium/chromedriver still missing after install" >&2; exit 1; }
