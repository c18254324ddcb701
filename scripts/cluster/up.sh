#!/usr/bin/env bash
# Start a private two-node cluster on this machine, everything under DIR (default: a new temp dir):
#   munged (own key and socket); slurmctld + two slurmd ("nodes" n1 on 127.0.0.1 and n2 on
#   127.0.0.2, one CPU and one GRES "gpu" each: File=/dev/null, so --gpus-per-node=1 is allocated
#   as on a GPU cluster; without a File slurmd reports 0 gpus and the node goes INVAL); and sshd
#   listening on 127.0.0.1 and 127.0.0.2 (two ssh "hosts", root by key only).
# Ports are free ones picked now. Prints DIR; DIR/env.sh exports what clients need (SLURM_CONF,
# STX_SSH_CONFIG, HYDRA_LAUNCHER_EXEC). Stop with down.sh DIR (by the pids in DIR/*.pid).
# Settings verified on Debian 12 (Slurm 22.05, OpenSSH 9.2, MPICH 4.0); README.md, "Running on a cluster".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
"$here/install.sh"
dir=${1:-$(mktemp -d /tmp/stx-cluster.XXXXXX)}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
free_ports() {  # N free TCP ports on 127.0.0.1
    python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r ctld_port d1_port d2_port ssh_port <<<"$(free_ports 4)"
host=$(hostname -s)

# munge: its own key, socket and pid file
head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 0400 "$dir/munge.key"
munged --force -S "$dir/munge.sock" --key-file "$dir/munge.key" --pid-file "$dir/munged.pid" \
    --log-file "$dir/munged.log" --seed-file "$dir/munge.seed"

# slurm
mkdir -p "$dir/state" "$dir/spool"
cat >"$dir/slurm.conf" <<CONF
ClusterName=stxtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d1_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdPidFile=$dir/d-%n.pid
SlurmdLogFile=$dir/d-%n.log
KillWait=2
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$d1_port CPUs=1 RealMemory=8000 Gres=gpu:1
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.2 Port=$d2_port CPUs=1 RealMemory=8000 Gres=gpu:1
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
cat >"$dir/gres.conf" <<CONF
Name=gpu Count=1 File=/dev/null
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld
slurmd -N n1
slurmd -N n2

# sshd on two loopback addresses, root by key only
mkdir -p /run/sshd
ssh-keygen -q -t ed25519 -N '' -f "$dir/ssh_host_key"
ssh-keygen -q -t ed25519 -N '' -f "$dir/id_client"
cp "$dir/id_client.pub" "$dir/authorized_keys"
cat >"$dir/sshd_config" <<CONF
Port $ssh_port
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey $dir/ssh_host_key
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
AcceptEnv *
PidFile $dir/sshd.pid
CONF
/usr/sbin/sshd -f "$dir/sshd_config" -E "$dir/sshd.log"
cat >"$dir/ssh_config" <<CONF
Host *
    Port $ssh_port
    User $(id -un)
    IdentityFile $dir/id_client
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
CONF
# MPICH hydra's -launcher-exec takes one executable, not a command line: a wrapper adds -F.
cat >"$dir/ssh" <<CONF
#!/bin/sh
exec ssh -F $dir/ssh_config "\$@"
CONF
chmod +x "$dir/ssh"
cat >"$dir/env.sh" <<CONF
export SLURM_CONF=$dir/slurm.conf
export STX_SSH_CONFIG=$dir/ssh_config
export HYDRA_LAUNCHER=ssh
export HYDRA_LAUNCHER_EXEC=$dir/ssh
CONF

# ready: both nodes idle, and ssh answers on both addresses
for _ in $(seq 1 60); do
    if [ "$(sinfo -h -o '%T' -N 2>/dev/null | grep -c '^idle')" = 2 ]; then break; fi
    sleep 0.5
done
sinfo -h -N -o '%N %T' | grep -q 'n2 idle' || { echo "slurm did not come up; see $dir/*.log" >&2; exit 1; }
for addr in 127.0.0.1 127.0.0.2; do
    ssh -F "$dir/ssh_config" "$addr" true || { echo "sshd on $addr does not answer; see $dir/sshd.log" >&2; exit 1; }
done
echo "$dir"
