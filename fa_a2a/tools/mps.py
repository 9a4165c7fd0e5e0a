"""P rank processes on fewer GPUs: the rank's device, and a private CUDA MPS daemon.

Processes sharing one GPU without MPS time-slice it: a spin-waiting barrier in one process waits
for a context switch before another process's kernel runs, so an eager call takes milliseconds.
Under an MPS daemon their kernels run at once. A private daemon needs two directories and touches
no GPU setting (no clocks, compute mode, MIG or persistence): `mps_daemon()` starts one, exports
CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY for the processes started inside it, and always
stops it. Processes whose CUDA context exists before the daemon starts do not use it.

    python -m fa_a2a.mps [--thread-percentage N] -- torchrun --nproc-per-node=2 -m fa_a2a.bench ...

Nothing here imports torch at module level: the command line parses its arguments first.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator, Optional

logger = logging.getLogger("fa_a2a")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_VAR, LOG_VAR, PERCENT_VAR = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's pipe directory when CUDA_MPS_PIPE_DIRECTORY is unset
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon, removed when it stops
START_TIMEOUT_S = 10.0  # until a started daemon answers
STOP_TIMEOUT_S = 10.0  # until a daemon told to quit has exited
COMMAND_TIMEOUT_S = 10.0  # one control command


class MpsUnavailableError(RuntimeError):
    """An MPS daemon cannot be started here; the message says why."""


# ------------------------------------------------------------------------------ the rank's device
_shared_gpu_logged = False


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def rank_device(local_rank: Optional[int] = None, *, local_world_size: Optional[int] = None) -> "torch.device":
    """cuda:(local_rank % device_count), made current. local_rank defaults to $LOCAL_RANK (0 if
    unset), local_world_size to $LOCAL_WORLD_SIZE (unset: not known, nothing logged). With more
    local ranks than GPUs, logs once per process (logger "fa_a2a") which ranks share this GPU and
    whether an MPS daemon is reachable from this environment: without one they time-slice it."""
    import torch

    name = "local_rank"
    if local_rank is None:
        name, local_rank = "LOCAL_RANK", _env_int("LOCAL_RANK", 0)
    _check_count(name, local_rank, 0)
    lws_name = "local_world_size"
    if local_world_size is None:
        lws_name, local_world_size = "LOCAL_WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE", None)
    if local_world_size is not None:
        _check_count(lws_name, local_world_size, 1)
        if local_rank >= local_world_size:
            raise ValueError(f"{name}: expected an int < {lws_name} = {local_world_size}, got {local_rank}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 0:
        raise RuntimeError("rank_device: CUDA has no device here (torch.cuda.device_count() == 0)")
    index = local_rank % n_gpus
    torch.cuda.set_device(index)
    if local_world_size is not None and local_world_size > n_gpus:
        _log_shared_gpu(index, n_gpus, local_world_size)
    return torch.device("cuda", index)


def _log_shared_gpu(index: int, n_gpus: int, local_world_size: int) -> None:
    global _shared_gpu_logged
    if _shared_gpu_logged:
        return
    _shared_gpu_logged = True
    ranks = ", ".join(str(r) for r in range(index, local_world_size, n_gpus))
    where = f"{local_world_size} local ranks on {n_gpus} GPU(s): local ranks {ranks} share cuda:{index}"
    if mps_reachable():
        logger.info("%s under the MPS daemon of %s: their kernels run concurrently", where, _pipe_dir())
    else:
        env = f"{PIPE_VAR}={os.environ[PIPE_VAR]}" if PIPE_VAR in os.environ else f"{PIPE_VAR} unset"
        logger.warning("%s and no MPS daemon is reachable from this process's environment (%s): they "
                       "time-slice the GPU, so their timings say nothing about separate GPUs. Run them "
                       "under `python -m fa_a2a.mps -- ...`", where, env)


# ------------------------------------------------------------------------------ the MPS daemon
def _pipe_dir() -> str:
    return os.environ.get(PIPE_VAR) or DEFAULT_PIPE_DIR


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's (a system daemon)
        return True
    try:  # an exited daemon nobody reaped yet (a container's init may never) is a zombie: gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _daemon_pid(pipe_dir: str) -> Optional[int]:
    """The pid of the control daemon serving pipe_dir, if it is alive."""
    try:
        with open(os.path.join(pipe_dir, PID_FILE)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def mps_reachable() -> bool:
    """Whether processes started from this environment would connect to an MPS daemon: the pipe
    directory (CUDA_MPS_PIPE_DIRECTORY, or CUDA's default) holds the control socket of a live
    control daemon. Processes whose CUDA context already exists are not affected either way."""
    pipe_dir = _pipe_dir()
    return os.path.exists(os.path.join(pipe_dir, "control")) and _daemon_pid(pipe_dir) is not None


def mps_available() -> bool:
    """The MPS control binary is on PATH and CUDA has a device (for tests to decide)."""
    if shutil.which(CONTROL_BINARY) is None:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _send(binary: str, command: str) -> subprocess.CompletedProcess | None:
    """One command to the daemon of os.environ's pipe directory; None when it timed out."""
    try:
        return subprocess.run([binary], input=command + "\n", capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def mps_control(command: str) -> str:
    """Sends one command (e.g. "get_server_list") to the MPS daemon of this environment and
    returns its answer. MpsUnavailableError when the binary is missing or the daemon does not answer."""
    binary = shutil.which(CONTROL_BINARY)
    if binary is None:
        raise MpsUnavailableError(f"{CONTROL_BINARY} is not on PATH")
    res = _send(binary, command)
    if res is None or res.returncode != 0:
        why = f"no answer within {COMMAND_TIMEOUT_S:g} s" if res is None else \
            f"exit {res.returncode}: {(res.stderr or res.stdout).strip()}"
        raise MpsUnavailableError(f"{CONTROL_BINARY} {command!r} in {_pipe_dir()}: {why}")
    return res.stdout


def _log_tail(log_dir: str, lines: int = 8) -> str:
    try:
        with open(os.path.join(log_dir, "control.log"), errors="replace") as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()][-lines:]
    except OSError:
        return "no control.log"
    return " | ".join(tail) if tail else "control.log is empty"


def _start(binary: str, log_dir: str) -> None:
    pipe_dir = os.environ[PIPE_VAR]
    with tempfile.TemporaryFile("w+") as out:  # not a pipe: a daemon that kept it open would block us
        try:
            rc = subprocess.run([binary, "-d"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                timeout=COMMAND_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        out.seek(0)
        said = out.read().strip()
    if rc != 0:
        raise MpsUnavailableError(f"the MPS control daemon did not start ({CONTROL_BINARY} -d: exit {rc}"
                                  f"{': ' + said if said else ''}); its log: {_log_tail(log_dir)}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if _daemon_pid(pipe_dir) is not None:
            res = _send(binary, "get_server_list")
            if res is not None and res.returncode == 0:
                return
        if time.monotonic() > deadline:
            raise MpsUnavailableError(f"the MPS control daemon did not answer within {START_TIMEOUT_S:g} s; "
                                      f"its log: {_log_tail(log_dir)}")
        time.sleep(0.05)


def _stop(binary: str) -> None:
    pipe_dir = os.environ[PIPE_VAR]
    pid = _daemon_pid(pipe_dir)
    res = _send(binary, "quit")  # also when the start failed half-way
    if res is None or res.returncode != 0:
        logger.warning("MPS daemon in %s: quit got %s", pipe_dir,
                       "no answer" if res is None else f"exit {res.returncode}: {res.stderr.strip()}")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            logger.warning("MPS control daemon (pid %d) still runs %g s after quit (clients still "
                           "connected?); its directories are removed", pid, STOP_TIMEOUT_S)
            return
        time.sleep(0.05)


def _exit_on_sigterm():
    """While a private daemon runs, SIGTERM (e.g. an outer `timeout`) ends the process through
    SystemExit, so mps_daemon's clean-up still quits the daemon (the default action would leave it
    running). Returns the handler to restore, or None where none was set (not the main thread, or
    a handler of the program's own already there)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old = signal.getsignal(signal.SIGTERM)
    if old not in (signal.SIG_DFL, None):
        return None

    def exit_(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_)
    return old


@contextlib.contextmanager
def mps_daemon(thread_percentage: Optional[float] = None) -> Iterator[str]:
    """Runs the block with an MPS daemon for the processes it starts; yields the pipe directory.

    Reuses a daemon already reachable from this environment; otherwise starts a private one in
    temporary directories, exports CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, and on the way
    out (exceptions and KeyboardInterrupt included) tells it to quit and removes the directories.
    thread_percentage (0, 100]: exported as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the share of the
    GPU's SMs each client may use (e.g. 100 / P). The variables are restored afterwards.
    MpsUnavailableError (one line) where no daemon can start."""
    if thread_percentage is not None and (isinstance(thread_percentage, bool)
                                          or not isinstance(thread_percentage, (int, float))
                                          or not 0 < thread_percentage <= 100):
        raise ValueError(f"thread_percentage: expected a number in (0, 100], got {thread_percentage!r}")
    saved = {name: os.environ.get(name) for name in (PIPE_VAR, LOG_VAR, PERCENT_VAR)}
    try:
        if thread_percentage is not None:
            os.environ[PERCENT_VAR] = f"{thread_percentage:g}"
        if mps_reachable():
            logger.info("using the MPS daemon already running in %s", _pipe_dir())
            yield _pipe_dir()
            return
        binary = shutil.which(CONTROL_BINARY)
        if binary is None:
            raise MpsUnavailableError(f"{CONTROL_BINARY} is not on PATH (CUDA's MPS control daemon, "
                                      "installed with the NVIDIA driver)")
        pipe_dir = tempfile.mkdtemp(prefix="fa_a2a-mps-pipe-")
        log_dir = tempfile.mkdtemp(prefix="fa_a2a-mps-log-")
        os.environ[PIPE_VAR], os.environ[LOG_VAR] = pipe_dir, log_dir
        old_term = _exit_on_sigterm()
        try:
            _start(binary, log_dir)
            logger.info("MPS daemon started in %s", pipe_dir)
            yield pipe_dir
        finally:
            try:
                _stop(binary)
            finally:
                shutil.rmtree(pipe_dir, ignore_errors=True)
                shutil.rmtree(log_dir, ignore_errors=True)
                if old_term is not None:
                    signal.signal(signal.SIGTERM, old_term)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------ command line
def _percentage(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 100], got {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 100], got {text!r}")
    return value


def _run(command: list[str]) -> int:
    """Runs command (its own session: a signal sent to us reaches it once, forwarded) to its end."""
    try:
        proc = subprocess.Popen(command, start_new_session=True)
    except OSError as e:
        print(f"fa_a2a.tools.mps: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as a shell reports it


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fa_a2a.mps",
        description="Run a command (e.g. torchrun with P ranks on one GPU) under a private CUDA MPS "
                    "daemon, stopped afterwards; exits with the command's exit code.",
        epilog="example: python -m fa_a2a.mps -- torchrun --nproc-per-node=2 -m fa_a2a.bench --quick")
    ap.add_argument("--thread-percentage", type=_percentage, metavar="N",
                    help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for the command's processes: each may use "
                         "at most N%% of the GPU's SMs (e.g. 100/P); default: no cap")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("command: expected a command after --, got none")
    logging.basicConfig(level=logging.INFO, format="fa_a2a.tools.mps: %(message)s")
    try:
        with mps_daemon(args.thread_percentage):
            return _run(command)
    except MpsUnavailableError as e:
        print(f"fa_a2a.tools.mps: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
