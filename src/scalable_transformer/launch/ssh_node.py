"""`python -m scalable_transformer.launch.ssh_node CMD...`: run CMD on a host reached over ssh, and
stop it (with its whole process tree) when the ssh session that started it goes away.

sshd does not signal a command when the client disconnects; it closes the command's stdin. So
this wrapper reads its stdin until end of file (the launcher on the first host never writes to
it), then sends SIGTERM to CMD's tree (`stx launch` stops its ranks), SIGKILL 10 s later. SIGTERM
and SIGHUP to the wrapper do the same. Exits with CMD's exit code (128 + N after signal N).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import psutil


def _stop(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m scalable_transformer.launch.ssh_node COMMAND [ARGS...]", file=sys.stderr)
        return 2
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def watch_stdin() -> None:
        with contextlib.suppress(OSError):  # the raw descriptor: no buffered reader at shutdown
            while os.read(0, 4096):
                pass
        if proc.poll() is None:
            print("ssh_node: the ssh session closed; stopping the ranks on this host", file=sys.stderr)
            _stop(proc)

    def on_signal(signum: int, frame: object) -> None:
        threading.Thread(target=_stop, args=(proc,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    threading.Thread(target=watch_stdin, daemon=True).start()
    code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: the stdin watcher may still be blocked in read()
