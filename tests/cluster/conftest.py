"""A real two-node cluster for the session: munged, slurmctld, two slurmd ("nodes" n1 and n2 on
127.0.0.1 and 127.0.0.2), and sshd on both addresses, started by scripts/cluster/up.sh (which
apt-get installs slurm-wlm, munge, openssh-server, pdsh and mpich when they are missing and we are
root) and stopped by scripts/cluster/down.sh at the end, by pid. Skips, with the reason, only
where the packages cannot be installed (not root, no apt-get)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[2] / "scripts" / "cluster"
NOT_INSTALLABLE = 3  # install.sh's exit status when it cannot install (the reason is on stderr)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The cluster's directory; SLURM_CONF, STX_SSH_CONFIG and HYDRA_LAUNCHER(_EXEC) point at it
    for the whole session (and the processes the tests start)."""
    if os.geteuid() != 0:
        # install.sh needs apt-get as root; the daemons run as root too (SlurmUser=root, sshd).
        pytest.skip("the private Slurm/sshd cluster needs root (apt-get install, slurmd, sshd): not root")
    install = subprocess.run([str(SCRIPTS / "install.sh")], capture_output=True, text=True, timeout=900)
    if install.returncode == NOT_INSTALLABLE:
        pytest.skip(f"no cluster tools: {install.stderr.strip()}")
    assert install.returncode == 0, install.stderr[-3000:]
    directory = tmp_path_factory.mktemp("cluster")
    saved: dict[str, str | None] = {}
    up = subprocess.run([str(SCRIPTS / "up.sh"), str(directory)], capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
        exports = {
            "SLURM_CONF": str(directory / "slurm.conf"),
            "STX_SSH_CONFIG": str(directory / "ssh_config"),
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(directory / "ssh"),
        }
        saved.update({k: os.environ.get(k) for k in exports})
        os.environ.update(exports)
        yield directory
    finally:
        subprocess.run([str(SCRIPTS / "down.sh"), str(directory)], timeout=60, check=False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
