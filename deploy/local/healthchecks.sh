#!/usr/bin/env bash
# Run every running podman container's healthcheck every INTERVAL seconds (default 5, compose.yaml's interval), as
# podman's own timers would: they are systemd timers, and without systemd podman never runs
# a healthcheck ("unable to get systemd connection to start healthchecks"), so compose's
# `condition: service_healthy` would wait forever. Each run is the container's own check
# (compose.yaml's `healthcheck.test`); podman records the result that compose reads.
#   deploy/local/healthchecks.sh [INTERVAL] &
set -uo pipefail
interval="${1:-5}"
while true; do
    for id in $(podman ps -q --filter health=starting) $(podman ps -q --filter health=healthy) \
              $(podman ps -q --filter health=unhealthy); do
        podman healthcheck run "$id" >/dev/null 2>&1 &
    done
    wait
    sleep "$interval"
done
