#!/usr/bin/env bash
# Install what the cluster tests need (Debian packages): Slurm + munge, sshd, pdsh, MPICH.
# Does nothing when every tool is already there; installs with apt-get when root; otherwise says
# why it cannot and exits 3 (the test fixture turns that into a skip with this message).
set -euo pipefail
need=(slurmctld slurmd munged sshd mpiexec.hydra pdsh sbatch)
missing=()
for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "cluster tools missing (${missing[*]}) and not root: cannot apt-get install slurm-wlm munge openssh-server pdsh mpich" >&2
    exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "cluster tools missing (${missing[*]}) and no apt-get on this machine" >&2
    exit 3
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq slurm-wlm munge openssh-server pdsh mpich; } >"$log" 2>&1; then
    # no package mirror reachable, a held package, ...: the packages cannot be installed here
    echo "apt-get could not install slurm-wlm munge openssh-server pdsh mpich: $(tail -n 3 "$log" | tr '\n' ' ')" >&2
    rm -f "$log"
    exit 3
fi
rm -f "$log"
echo "installed slurm-wlm munge openssh-server pdsh mpich" >&2
