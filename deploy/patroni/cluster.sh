#!/usr/bin/env bash
# A two-node PostgreSQL cluster under Patroni with one etcd, on this machine:
# the recipe the HA test runs, and an operator can read (docs/OPERATIONS.md,
# "Behind Patroni"). Synchronous replication is strict, so an acknowledged
# commit is always on the standby too: bootstrapped non-strict, and made
# strict through the DCS once a synchronous standby streams (`strict`).
#
#   cluster.sh start DIR BASE_PORT   etcd on BASE_PORT (peers BASE_PORT+1),
#                                    Postgres node1/node2 on BASE_PORT+10/+11,
#                                    Patroni's REST API on BASE_PORT+20/+21
#   cluster.sh strict DIR            synchronous_mode_strict on, once the
#                                    leader has its synchronous standby
#   cluster.sh node DIR NAME         starts one node's Patroni again
#   cluster.sh stop DIR              stops everything it started
#
# The service is pointed at both nodes:
#   postgres://postgres@127.0.0.1:P1,127.0.0.1:P2/intake?target_session_attrs=read-write
# Needs Debian's patroni, etcd-server and postgresql-15; runs the nodes as
# the `postgres` user. Trust authentication on 127.0.0.1: a test cluster,
# not a production one (give real passwords and TLS there).
set -euo pipefail

cmd=${1:?start, node or stop}
dir=${2:?a directory for the cluster}
pg_bin=${PG_BIN:-/usr/lib/postgresql/15/bin}

start_node() {
  local name=$1
  runuser -u postgres -- bash -c \
    "exec patroni '$dir/$name.yml' >>'$dir/$name.log' 2>&1" &
  echo $! >"$dir/$name.patroni.pid"
}

case "$cmd" in
start)
  base=${3:?a base port}
  mkdir -p "$dir"
  chown postgres:postgres "$dir"
  chmod 700 "$dir"
  runuser -u postgres -- bash -c \
    "exec etcd --name etcd0 --data-dir '$dir/etcd' \
       --listen-client-urls http://127.0.0.1:$base --advertise-client-urls http://127.0.0.1:$base \
       --listen-peer-urls http://127.0.0.1:$((base + 1)) --initial-advertise-peer-urls http://127.0.0.1:$((base + 1)) \
       --initial-cluster etcd0=http://127.0.0.1:$((base + 1)) --enable-v2=true \
       >>'$dir/etcd.log' 2>&1" &
  echo $! >"$dir/etcd.pid"
  for n in 1 2; do
    cat >"$dir/node$n.yml" <<YAML
scope: plan-intake
namespace: /plan-intake-test/
name: node$n
restapi:
  listen: 127.0.0.1:$((base + 19 + n))
  connect_address: 127.0.0.1:$((base + 19 + n))
etcd:
  host: 127.0.0.1:$base
bootstrap:
  dcs:
    # Failover within seconds: the leader key lives 10 s.
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    # Every commit waits for the synchronous standby. Strict mode (a leader
    # left alone holds every commit rather than run unreplicated) is turned
    # on only once a synchronous standby streams (cluster.sh strict):
    # bootstrapped strict, Debian's Patroni 3.0.2 puts '*' in
    # synchronous_standby_names before its post-bootstrap step, whose
    # txid_current() then waits for a standby that cannot connect yet (no
    # replication slot): node stuck in "bootstrap in progress" and the other
    # "waiting for leader to bootstrap" for good (fixed in Patroni 3.0.4,
    # patroni/patroni#2741).
    synchronous_mode: true
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        max_connections: 100
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
  pg_hba:
    - local all all trust
    - host replication replicator 127.0.0.1/32 trust
    - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:$((base + 9 + n))
  connect_address: 127.0.0.1:$((base + 9 + n))
  data_dir: $dir/node$n
  bin_dir: $pg_bin
  pgpass: $dir/pgpass$n
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
    rewind:
      username: postgres
      password: postgres
  parameters:
    unix_socket_directories: '$dir'
    # Postgres's own lines (a port it cannot bind, a failed start) go to
    # stderr, which this node's log (nodeN.log) takes beside Patroni's.
    logging_collector: "off"
    log_destination: stderr
YAML
    chown postgres:postgres "$dir/node$n.yml"
  done
  start_node node1
  start_node node2
  ;;
strict)
  # Through the DCS, as an operator would: every node takes it at its next
  # loop.
  runuser -u postgres -- patronictl -c "$dir/node1.yml" edit-config --force \
    --set synchronous_mode_strict=true >>"$dir/patronictl.log" 2>&1
  ;;
node)
  start_node "${3:?node1 or node2}"
  ;;
stop)
  for pidfile in "$dir"/*.patroni.pid "$dir/etcd.pid"; do
    [ -e "$pidfile" ] || continue
    pkill -KILL -P "$(cat "$pidfile")" 2>/dev/null || true
    kill -KILL "$(cat "$pidfile")" 2>/dev/null || true
  done
  pkill -KILL -f "patroni $dir/" 2>/dev/null || true
  pkill -KILL -f "etcd --name etcd0 --data-dir $dir/" 2>/dev/null || true
  for n in 1 2; do
    if [ -e "$dir/node$n/postmaster.pid" ]; then
      kill -KILL "$(head -n 1 "$dir/node$n/postmaster.pid")" 2>/dev/null || true
    fi
  done
  ;;
*)
  echo "usage: cluster.sh start DIR BASE_PORT | strict DIR | node DIR NAME | stop DIR" >&2
  exit 2
  ;;
esac
