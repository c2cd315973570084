#!/usr/bin/env bash
# A real Slurm (with accounting), Open MPI and mpi4py on this one machine, for the cluster tests and CI.
#
#   scripts/local_slurm.sh check    # can this machine host it? (root on Debian 12); exit 0 or say why not
#   scripts/local_slurm.sh up       # install (apt) and start: munged, mariadbd, slurmdbd, slurmctld, 2 x slurmd
#   scripts/local_slurm.sh status   # exit 0 when up (prints sinfo), 1 when down
#   scripts/local_slurm.sh down     # stop what `up` started (by pid) and remove its /etc/hosts lines
#
# Two fake nodes, node1 and node2, run as two slurmd processes on this host, so multi-node jobs (SLURM_NODEID,
# node lists, per-node TmpFS) are exercised for real. Every daemon is started by hand: no systemd is needed.
# After `up`, mpirun needs `source $LOCAL_SLURM_PREFIX/env.sh` (Open MPI settings for root and for fake nodes).
#
# Settings (environment): LOCAL_SLURM_PREFIX (state and logs; default /tmp/hpc_rlhf-slurm), CPUS_PER_NODE
# (default 8: more than the real cores, so that several test jobs run at once), VENV (where mpi4py goes;
# default the project's .venv), SKIP_APT=1, SKIP_MPI4PY=1.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${LOCAL_SLURM_PREFIX:-/tmp/hpc_rlhf-slurm}
CPUS_PER_NODE=${CPUS_PER_NODE:-8}
VENV=${VENV:-$REPO/.venv}
NODES=(node1 node2)
PACKAGES="munge slurmctld slurmd slurm-client slurmdbd mariadb-server openmpi-bin libopenmpi-dev"
RUN=$PREFIX/run
LOGS=$PREFIX/log
DB=$PREFIX/db
DB_PORT=33061  # not 3306: a site MariaDB on this host must not be disturbed
HOSTS_TAG="# hpc_rlhf local slurm"
CONF_TAG="Written by hpc_rlhf scripts/local_slurm.sh"
HOST=$(hostname -s)
T0=$(date +%s.%N)

log() { printf '[local_slurm %5.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*"; }
die() { echo "local_slurm: $*" >&2; exit 1; }
wait_for() {  # wait_for WHAT SECONDS COMMAND...: poll every 0.25 s
  local what=$1 seconds=$2; shift 2
  local tries=$((seconds * 4))
  for ((i = 0; i < tries; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  die "timed out after ${seconds}s waiting for $what (logs in $LOGS)"
}
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cannot_host_reason() {  # empty when this machine can host the cluster
  if [ "$(id -u)" != 0 ]; then echo "needs root (starts daemons, edits /etc/hosts, installs packages)"; return; fi
  if ! grep -qsE '^ID=debian' /etc/os-release; then echo "needs Debian (apt packages of Debian 12)"; return; fi
  if ! command -v apt-get >/dev/null; then echo "needs apt-get"; return; fi
  local conf
  for conf in /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf; do
    if [ -f "$conf" ] && ! grep -q "$CONF_TAG" "$conf"; then
      echo "$conf exists and was not written by this script (a real Slurm installation?); not replacing it"
      return
    fi
  done
}

is_up() {
  alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd-node1.pid" && alive "$RUN/slurmd-node2.pid" \
    && scontrol ping >/dev/null 2>&1
}

install_packages() {
  local missing=()
  for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} = 0 ] && { log "packages already installed"; return; }
  [ "${SKIP_APT:-0}" = 1 ] && die "SKIP_APT=1 but these packages are missing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  log "installed ${missing[*]}"
}

add_hosts() {
  # Node names must resolve: the master address of a job is the first host of its node list.
  grep -q "$HOSTS_TAG" /etc/hosts && return
  local names="${NODES[*]}"
  getent hosts "$HOST" >/dev/null || names="$names $HOST"
  echo "127.0.0.1 $names $HOSTS_TAG" >> /etc/hosts
}

remove_hosts() {
  # Rewritten in place, not with sed -i: /etc/hosts is often a bind mount, which cannot be replaced.
  local kept
  kept=$(grep -v "$HOSTS_TAG" /etc/hosts || true)
  printf '%s\n' "$kept" > /etc/hosts
}

start_munge() {
  mkdir -p /run/munge && chown munge:munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  munge -n >/dev/null 2>&1 && return  # a site munged is used as it is, and left running by `down`
  runuser -u munge -- /usr/sbin/munged
  wait_for munged 10 munge -n
  cp /run/munge/munged.pid "$RUN/munged.pid"
}

start_accounting() {
  # submitit polls sacct; without accounting a job that dies leaves job.result() waiting forever.
  if [ ! -d "$DB/data/mysql" ]; then
    mkdir -p "$DB"
    mariadb-install-db --user=root --datadir="$DB/data" --auth-root-authentication-method=socket \
      --skip-test-db >"$LOGS/mariadb-install.log" 2>&1
  fi
  setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DB/data" --socket="$DB/mysql.sock" \
    --pid-file="$RUN/mariadbd.pid" --bind-address=127.0.0.1 --port=$DB_PORT --skip-name-resolve \
    --innodb-buffer-pool-size=32M --log-error="$LOGS/mariadb.log" </dev/null >/dev/null 2>&1 &
  wait_for mariadb 60 mariadb --no-defaults -S "$DB/mysql.sock" -uroot -e 'select 1'
  mariadb --no-defaults -S "$DB/mysql.sock" -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
  cat > /etc/slurm/slurmdbd.conf <<EOF
# $CONF_TAG: accounting for the local test cluster.
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
EOF
  chmod 600 /etc/slurm/slurmdbd.conf
  /usr/sbin/slurmdbd
  wait_for slurmdbd 60 bash -c 'exec 3<>/dev/tcp/127.0.0.1/6819'
}

write_slurm_conf() {
  cat > /etc/slurm/slurm.conf <<EOF
# $CONF_TAG: two fake nodes on one host, for tests.
ClusterName=hpcrlhf
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after its credentials expire (default 120 s): 10 s keeps tests short.
AuthInfo=cred_expire=10
# Debian's Open MPI is PMIx-only, so srun's default MPI plugin must be pmix.
MpiDefault=pmix
# No cgroups in containers: track processes by parent id and bind no CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Accept more CPUs than the machine has: each fake node declares $CPUS_PER_NODE.
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
# Look at the queue every 2 s, so that a requeued job restarts in seconds.
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
StateSaveLocation=$PREFIX/state
SlurmdSpoolDir=$PREFIX/spool/%n
TmpFS=$PREFIX/tmp/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
MinJobAge=3600
KillWait=10
InactiveLimit=0
Waittime=0
# RealMemory is the node memory sbatch/common.sh's check reads for jobs with --mem=0 or without --mem: it must hold
# the check's estimate for the test jobs (4 GB a rank's process, up to 2 ranks a node). CR_Core does not schedule
# memory, and config_overrides keeps a host with less from draining the nodes.
NodeName=node[1-2] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS_PER_NODE RealMemory=32000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

write_env_file() {
  cat > "$PREFIX/env.sh" <<'EOF'
# Open MPI as root, on more ranks than cores, across fake nodes that share one host.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# Two slurmd "nodes" on one host: Open MPI's shared-memory transport (vader) collides between them and hangs.
export OMPI_MCA_btl=^vader
EOF
}

install_mpi4py() {
  [ "${SKIP_MPI4PY:-0}" = 1 ] && return
  if [ ! -x "$VENV/bin/python" ]; then log "no venv at $VENV: mpi4py not installed (make venv first)"; return; fi
  # mpi4py is the `mpi` extra; its wheel loads Debian's libmpi at run time, so nothing is compiled.
  "$VENV/bin/python" -c 'import mpi4py' 2>/dev/null || "$VENV/bin/pip" install -q 'mpi4py>=4.0'
  log "mpi4py $("$VENV/bin/python" -c 'import mpi4py; print(mpi4py.__version__)') in $VENV"
}

up() {
  local reason
  reason=$(cannot_host_reason)
  [ -z "$reason" ] || die "this machine cannot host the local cluster: $reason"
  if is_up; then
    echo "local slurm already up ($(sinfo -h -o '%D nodes %T' | paste -sd' ')); env: $PREFIX/env.sh"
    return 0
  fi
  stop_all quiet  # leftovers of a half-started or crashed cluster
  install_packages
  # Fresh controller state and database each time: job ids restart at 1, and an old database would hold
  # records of other jobs with those ids.
  rm -rf "$PREFIX/state" "$PREFIX/spool" "$PREFIX/tmp" "$LOGS" "$RUN" "$DB"
  mkdir -p "$PREFIX/state" "$LOGS" "$RUN" /etc/slurm
  for n in "${NODES[@]}"; do mkdir -p "$PREFIX/spool/$n" "$PREFIX/tmp/$n"; done
  add_hosts
  start_munge
  log "munged up"
  start_accounting
  log "mariadb + slurmdbd up"
  write_slurm_conf
  /usr/sbin/slurmctld
  wait_for slurmctld 60 scontrol ping
  for n in "${NODES[@]}"; do /usr/sbin/slurmd -N "$n"; done
  nodes_idle() { [ "$(sinfo -h -o '%T' | sort -u)" = idle ]; }
  wait_for "nodes idle" 60 nodes_idle
  log "slurmctld + slurmd ${NODES[*]} up: $(sinfo -h -o '%D nodes %T %N')"
  write_env_file
  install_mpi4py
  log "up; source $PREFIX/env.sh before mpirun; stop with: $0 down"
}

stop_pidfile() {
  local file=$1 pid
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if kill "$pid" 2>/dev/null; then
    for ((i = 0; i < 80; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    [ "${2:-}" = quiet ] || log "stopped $(basename "$file" .pid) (pid $pid)"
  fi
  rm -f "$file"
}

stop_all() {
  [ -d "$RUN" ] || { [ "${1:-}" = quiet ] || echo "local slurm is not up"; remove_hosts; return 0; }
  if alive "$RUN/slurmctld.pid"; then
    scancel --quiet --full --user=root 2>/dev/null || true
  fi
  for f in "$RUN"/slurmd-*.pid; do stop_pidfile "$f" "${1:-}"; done
  for d in slurmctld slurmdbd mariadbd munged; do stop_pidfile "$RUN/$d.pid" "${1:-}"; done
  remove_hosts
}

status() {
  if is_up; then
    echo "local slurm up (prefix $PREFIX)"
    sinfo
    return 0
  fi
  echo "local slurm is not up"
  return 1
}

case "${1:-}" in
  up) up ;;
  down) stop_all; log "down" ;;
  status) status ;;
  check)
    reason=$(cannot_host_reason)
    if [ -n "$reason" ]; then echo "cannot host: $reason"; exit 1; fi
    echo "this machine can host the local cluster" ;;
  *) echo "usage: $0 up|down|status|check" >&2; exit 2 ;;
esac
