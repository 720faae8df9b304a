#!/bin/sh
# System packages for the integration test bed (tests/testbed.py): network namespaces, a bridge, veth pairs and
# one sshd per test host. Idempotent: installs only what is missing. Run as root (CI: `sudo scripts/testbed-setup.sh`).
set -eu

if [ "$(id -u)" -ne 0 ]; then
    echo "testbed-setup: must run as root" >&2
    exit 1
fi

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
missing=""
for pair in ip:iproute2 sshd:openssh-server ssh:openssh-client ssh-keygen:openssh-client \
        unshare:util-linux nsenter:util-linux mount:mount pkill:procps chromium:chromium \
        chromedriver:chromium-driver; do
    cmd=${pair%%:*}
    pkg=${pair#*:}
    if ! command -v "$cmd" >/dev/null 2>&1; then
        case " $missing " in *" $pkg "*) ;; *) missing="$missing $pkg" ;; esac
    fi
done

if [ -n "$missing" ]; then
    echo "testbed-setup: installing$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $missing
fi

# The test hosts run their own sshd; the system one is not needed. sshd wants its privilege-separation
# directory, and each host bind-mounts its own directory onto /srv.
mkdir -p /run/sshd /srv
chmod 0755 /run/sshd

echo "testbed-setup: ok ($(ssh -V 2>&1); $(ip -V))"
