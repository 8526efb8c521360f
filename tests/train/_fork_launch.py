"""A fork server for the multi-process trainer tests: torch and trainguard are imported once, and each run's
ranks are forked from that interpreter, with the environment torchrun gives its workers.

Why: on a 2-core machine a fresh interpreter spends 7-8 s importing torch, trainguard, pipelining and DCP,
and a ``torchrun`` run starts three of them (the agent and two workers). That was about half of each two-stage
test's time. A forked rank starts from an interpreter that has imported everything and run nothing, so it is
the same program as a fresh one: each run still gets new processes, a new process group on a new port, and new
module state. (Forking after importing torch is what a DataLoader's forked workers do; torch registers fork
handlers for its thread pools.) What it does not exercise is torch's launcher; the tests of ``trainguard train`` with
``distributed.dp`` (tests/train/test_ddp.py, tests/cli/test_train_cli.py) still launch through it, and
``TRAINGUARD_TEST_TORCHRUN=1`` runs these tests through ``torchrun`` as well.

Like torchrun, the server stops a run's other ranks when one fails (they would wait in a collective forever).

Protocol (one JSON object a line): the client sends ``{"script", "args", "nproc", "cwd", "logs"}``; the server
answers ``{"pids": [...]}`` once the ranks are forked, then ``{"rcs": [...]}`` (exit codes by rank).
Relies on the standard library only (os.fork, runpy, select).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

PREIMPORT = ("torch", "torch.distributed.pipelining", "torch.distributed.checkpoint", "trainguard.train",
             "trainguard.sdc.runtime", "trainguard.faults", "trainguard.config", "tests.sdc.dmr._spy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(job: dict, rank: int, port: int) -> None:
    """In a forked child: become rank ``rank`` of the job, run its script as ``__main__``, exit. Never returns."""
    rc = 1
    try:
        fd = os.open(job["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        n = job["nproc"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        os.chdir(job["cwd"])
        sys.argv = [job["script"], *job["args"]]
        runpy.run_path(job["script"], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve() -> None:
    for name in PREIMPORT:  # (imports only: a thread pool or a process group made here would be forked half-alive)
        importlib.import_module(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        port = _free_port()
        ranks = {}
        for r in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(job, r, port)
            ranks[pid] = r
        print(json.dumps({"pids": list(ranks)}), flush=True)
        rcs: dict[int, int] = {}
        while ranks:
            pid, status = os.waitpid(-1, 0)
            rcs[ranks.pop(pid)] = rc = os.waitstatus_to_exitcode(status)
            if rc != 0:  # the others would wait for it forever
                for other in ranks:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        print(json.dumps({"rcs": [rcs[r] for r in range(job["nproc"])]}), flush=True)


class JsonLineServer:
    """A server process spoken to in JSON lines (this module's fork server; test_preemption's zygote): started in
    its own session, so that closing it kills whatever it forked too."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None, start_timeout: float = 300):
        self._err = tempfile.TemporaryFile(mode="w+")  # (not a pipe: nobody reads it until it dies)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=env, cwd=cwd, start_new_session=True)
        if not self.read(start_timeout).get("ready"):
            raise RuntimeError("the server did not start")

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("the server did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            self._err.seek(0)
            raise RuntimeError(f"the server died: {self._err.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self._err.close()


class ForkLauncher(JsonLineServer):
    """The client of this module's fork server: one per test process, started on first use."""

    def __init__(self, env: dict[str, str]):
        super().__init__([sys.executable, __file__], env)

    def run(self, script: Path, args: list[str], nproc: int, cwd: Path, logdir: Path,
            timeout: float) -> tuple[list[int], list[Path]]:
        """Run ``script args`` as ``nproc`` ranks in ``cwd``; returns (exit codes by rank, their output's files, in
        ``logdir``). A run still going after ``timeout`` seconds has its ranks killed and raises TimeoutError."""
        logs = [Path(logdir) / f"rank{r}.log" for r in range(nproc)]
        job = {"script": str(script), "args": args, "nproc": nproc, "cwd": str(cwd), "logs": [str(p) for p in logs]}
        self.send(job)
        pids = self.read(60)["pids"]
        try:
            return self.read(timeout)["rcs"], logs
        except TimeoutError:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.read(60)
            raise


if __name__ == "__main__":
    serve()
