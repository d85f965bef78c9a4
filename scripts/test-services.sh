#!/bin/sh
# The gateway tests start a real redis-server and a real PostgreSQL of their own
# (on loopback ports, in temp folders), the HTTPS test needs openssl, and the
# dashboard tests a headless chromium (driven over its DevTools port: no download). Install
# them from Debian's packages when they are missing; needs root or sudo.
set -e
need=""
command -v redis-server >/dev/null 2>&1 || need="$need redis-server"
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need="$need postgresql"
command -v openssl >/dev/null 2>&1 || need="$need openssl"  # the HTTPS test makes a self-signed certificate
command -v chromium >/dev/null 2>&1 || need="$need chromium"  # the dashboard tests load the page in it
[ -z "$need" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "the gateway tests need:$need (apt-get install$need, as root)" >&2
    exit 1
fi
echo "installing$need from Debian's packages for the gateway tests"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $need >/dev/null
