"""fa_a2a.tools.mps without a GPU: rank_device's mapping (device count and set_device faked), the MPS
daemon context manager and command line against a fake nvidia-cuda-mps-control that records its
calls (a background `sleep` stands for the daemon), and the refusals."""
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from fa_a2a.tools import mps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE_CONTROL = textwrap.dedent("""\
    #!/bin/sh
    # a stand-in for nvidia-cuda-mps-control: -d starts a "daemon" (a sleep) and writes its pid file;
    # otherwise one command is read from stdin and answered. Every call is appended to $FAKE_MPS_CALLS.
    pid_file="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    if [ "$1" = "-d" ]; then
        echo "start" >> "$FAKE_MPS_CALLS"
        if [ -n "$FAKE_MPS_START_EXIT" ]; then echo "fake: permission denied"; exit "$FAKE_MPS_START_EXIT"; fi
        if [ -n "$FAKE_MPS_SILENT" ]; then echo "fake: no GPU" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0; fi
        sleep 120 </dev/null >/dev/null 2>&1 &
        echo $! > "$pid_file"
        touch "$CUDA_MPS_PIPE_DIRECTORY/control"
        exit 0
    fi
    read cmd
    echo "$cmd" >> "$FAKE_MPS_CALLS"
    if [ ! -f "$pid_file" ]; then echo "Cannot find MPS control daemon process" >&2; exit 1; fi
    if [ "$cmd" = "quit" ]; then kill "$(cat "$pid_file")"; rm -f "$pid_file"; fi
    exit 0
    """)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No MPS variables, and CUDA's default pipe directory moved to an empty place."""
    for name in (mps.PIPE_VAR, mps.LOG_VAR, mps.PERCENT_VAR):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", str(tmp_path / "no-default-daemon"))


@pytest.fixture
def fake_control(clean_env, monkeypatch, tmp_path):
    """The fake control binary first on PATH; returns a function that reads the recorded calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / mps.CONTROL_BINARY
    exe.write_text(FAKE_CONTROL)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_CALLS", str(calls))
    return lambda: calls.read_text().split() if calls.exists() else []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[-1].startswith("Z")  # a zombie is gone


# ------------------------------------------------------------------------------ rank_device
@pytest.fixture
def gpus(monkeypatch, clean_env):
    """Fakes n CUDA devices; returns (set n, the indices set_device got)."""
    state = {"n": 1, "set": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["n"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["n"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: state["set"].append(i))
    monkeypatch.setattr(mps, "_shared_gpu_logged", False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_n(n):
        state["n"] = n
    return set_n, state["set"]


@pytest.mark.parametrize("P, n_gpus, want", [(2, 1, [0, 0]), (4, 1, [0, 0, 0, 0]), (2, 2, [0, 1]),
                                             (4, 2, [0, 1, 0, 1])])
def test_rank_device_maps_local_ranks_round_robin(gpus, P, n_gpus, want):
    set_n, set_calls = gpus
    set_n(n_gpus)
    got = [mps.rank_device(r, local_world_size=P) for r in range(P)]
    assert got == [torch.device("cuda", i) for i in want]
    assert set_calls == want


def test_rank_device_reads_torchrun_variables(gpus, monkeypatch):
    set_n, set_calls = gpus
    set_n(2)
    assert mps.rank_device() == torch.device("cuda", 0)  # LOCAL_RANK unset: 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert mps.rank_device() == torch.device("cuda", 1)
    assert set_calls == [0, 1]


def test_rank_device_logs_sharing_once(gpus, caplog):
    set_n, _ = gpus
    set_n(2)
    with caplog.at_level(logging.INFO, logger="fa_a2a"):
        mps.rank_device(0, local_world_size=2)  # one GPU each: nothing to say
        assert not caplog.records
        mps.rank_device(3, local_world_size=4)
        mps.rank_device(3, local_world_size=4)
    assert len(caplog.records) == 1
    rec = caplog.records[0]
    assert rec.levelno == logging.WARNING
    assert "4 local ranks on 2 GPU(s): local ranks 1, 3 share cuda:1" in rec.getMessage()
    assert "no MPS daemon is reachable" in rec.getMessage() and "time-slice" in rec.getMessage()


def test_rank_device_log_names_a_reachable_daemon(gpus, caplog, monkeypatch, tmp_path):
    set_n, _ = gpus
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control").touch()
    (pipe / mps.PID_FILE).write_text(f"{os.getpid()}\n")  # a live process stands for the daemon
    monkeypatch.setenv(mps.PIPE_VAR, str(pipe))
    with caplog.at_level(logging.INFO, logger="fa_a2a"):
        mps.rank_device(1, local_world_size=2)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert f"share cuda:0 under the MPS daemon of {pipe}" in caplog.records[0].getMessage()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0", None])
def test_rank_device_refuses_bad_local_rank(gpus, bad):
    if bad is None:  # None means $LOCAL_RANK; bad local_world_size instead
        with pytest.raises(ValueError, match=r"^local_rank: expected an int < local_world_size = 2, got 2$"):
            mps.rank_device(2, local_world_size=2)
        return
    with pytest.raises(ValueError, match=r"^local_rank: expected an int >= 0, got "):
        mps.rank_device(bad)


def test_rank_device_refuses_bad_environment(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match=r"^LOCAL_RANK: expected an integer, got 'one'$"):
        mps.rank_device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE: expected an int >= 1, got 0$"):
        mps.rank_device()


def test_rank_device_without_a_cuda_device(gpus):
    set_n, set_calls = gpus
    set_n(0)
    with pytest.raises(RuntimeError, match=r"^rank_device: CUDA has no device here"):
        mps.rank_device(0)
    assert set_calls == []


# ------------------------------------------------------------------------------ mps_daemon
def test_no_binary_on_path_is_refused(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mps.MpsUnavailableError, match=f"^{mps.CONTROL_BINARY} is not on PATH"):
        with mps.mps_daemon(50):
            pytest.fail("the block must not run")
    assert mps.PIPE_VAR not in os.environ and mps.PERCENT_VAR not in os.environ
    assert not mps.mps_available()


def test_daemon_starts_exports_and_always_quits(fake_control):
    with mps.mps_daemon(thread_percentage=50) as pipe_dir:
        assert os.environ[mps.PIPE_VAR] == pipe_dir and os.path.isdir(os.environ[mps.LOG_VAR])
        assert os.environ[mps.PERCENT_VAR] == "50"
        assert mps.mps_reachable()
        pid = int(open(os.path.join(pipe_dir, mps.PID_FILE)).read())
        assert _alive(pid)
        assert mps.mps_control("get_server_list") == ""
        # a child process started here sees the daemon
        out = subprocess.run([sys.executable, "-c", f"import os; print(os.environ['{mps.PIPE_VAR}'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == pipe_dir
    assert fake_control() == ["start", "get_server_list", "get_server_list", "quit"]
    assert not _alive(pid) and not os.path.exists(pipe_dir)
    assert not any(v in os.environ for v in (mps.PIPE_VAR, mps.LOG_VAR, mps.PERCENT_VAR))


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_daemon_quits_when_the_block_raises(fake_control, monkeypatch, exc):
    monkeypatch.setenv(mps.PERCENT_VAR, "25")  # restored afterwards, not removed
    with pytest.raises(exc):
        with mps.mps_daemon(thread_percentage=12.5) as pipe_dir:
            assert os.environ[mps.PERCENT_VAR] == "12.5"
            pid = int(open(os.path.join(pipe_dir, mps.PID_FILE)).read())
            raise exc("rank failed")
    assert fake_control()[-1] == "quit"
    assert not _alive(pid) and not os.path.exists(pipe_dir)
    assert os.environ[mps.PERCENT_VAR] == "25" and mps.PIPE_VAR not in os.environ


def test_daemon_quits_when_the_process_gets_sigterm(fake_control, tmp_path):
    """An outer `timeout` (SIGTERM) still ends in quit: the default action would leave the daemon running."""
    script = ("import os, signal, time\n"
              "from fa_a2a.tools import mps\n"
              "with mps.mps_daemon() as pipe_dir:\n"
              "    print(open(os.path.join(pipe_dir, mps.PID_FILE)).read().strip(), flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert fake_control()[-1] == "quit"
    assert not _alive(int(res.stdout.split()[0]))
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process's handler untouched


def test_a_running_daemon_is_reused(fake_control):
    with mps.mps_daemon() as outer:
        with mps.mps_daemon() as inner:
            assert inner == outer
        assert mps.mps_reachable() and os.environ[mps.PIPE_VAR] == outer  # the inner one did not stop it
    assert fake_control().count("start") == 1 and fake_control().count("quit") == 1


def test_daemon_that_never_answers_is_refused_with_its_log(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_SILENT", "1")
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 0.3)
    with pytest.raises(mps.MpsUnavailableError, match=r"did not answer within 0.3 s; its log: fake: no GPU$"):
        with mps.mps_daemon():
            pytest.fail("the block must not run")
    assert fake_control()[0] == "start" and fake_control()[-1] == "quit"  # quit also after a failed start
    assert mps.PIPE_VAR not in os.environ


def test_daemon_start_failure_is_refused(fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_START_EXIT", "3")
    with pytest.raises(mps.MpsUnavailableError,
                       match=r"did not start \(nvidia-cuda-mps-control -d: exit 3: fake: permission denied\)"):
        with mps.mps_daemon():
            pytest.fail("the block must not run")
    assert fake_control() == ["start", "quit"]


@pytest.mark.parametrize("bad", [0, -5, 101, "50", True])
def test_bad_thread_percentage(clean_env, bad):
    with pytest.raises(ValueError, match=r"^thread_percentage: expected a number in \(0, 100\], got "):
        with mps.mps_daemon(bad):
            pytest.fail("the block must not run")


# ------------------------------------------------------------------------------ the test launcher
def test_launcher_runs_gpu_ranks_under_mps_where_it_can(fake_control, monkeypatch):
    import contextlib

    from tests import multiproc

    monkeypatch.setattr(multiproc, "mps_available", lambda: True)
    with contextlib.ExitStack() as stack:
        multiproc._enter_mps(stack)
        assert mps.mps_reachable()  # the processes spawned now are its clients
    assert fake_control() == ["start", "get_server_list", "quit"] and mps.PIPE_VAR not in os.environ
    monkeypatch.setenv("FA_A2A_TEST_MPS", "0")
    with contextlib.ExitStack() as stack:
        multiproc._enter_mps(stack)
        assert not mps.mps_reachable()
    monkeypatch.delenv("FA_A2A_TEST_MPS")
    monkeypatch.setenv("FAKE_MPS_START_EXIT", "1")  # MPS expected but it cannot start: time-sliced, said
    with pytest.warns(UserWarning, match="^rank processes time-slice the GPU: the MPS control daemon did not start"):
        with contextlib.ExitStack() as stack:
            multiproc._enter_mps(stack)
            assert not mps.mps_reachable()


# ------------------------------------------------------------------------------ command line
def _cli(args, tmp_path, env_extra=None, **kw):
    """python -m fa_a2a.mps args; its pipe directory without a daemon (not CUDA's default)."""
    env = dict(os.environ, **{mps.PIPE_VAR: str(tmp_path / "no-daemon"), **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "fa_a2a.tools.mps", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("args", [[], ["--"], ["--thread-percentage", "0", "--", "true"],
                                  ["--thread-percentage", "x", "--", "true"], ["--thread-percentage"]])
def test_cli_argument_errors_exit_2(fake_control, tmp_path, args):
    res = _cli(args, tmp_path)
    assert res.returncode == 2, res.stderr
    assert "usage: python -m fa_a2a.mps" in res.stderr
    assert fake_control() == []  # no daemon for a bad command line


@pytest.mark.parametrize("code", [0, 3])
def test_cli_passes_the_exit_code_through_and_quits(fake_control, tmp_path, code):
    probe = (f"import os, sys; print(os.environ['{mps.PIPE_VAR}'], os.environ['{mps.PERCENT_VAR}']); "
             f"sys.exit({code})")
    res = _cli(["--thread-percentage", "50", "--", sys.executable, "-c", probe], tmp_path)
    assert res.returncode == code, res.stderr
    pipe_dir, pct = res.stdout.split()
    assert pipe_dir.startswith(os.path.join(os.path.dirname(pipe_dir), "fa_a2a-mps-pipe-")) and pct == "50"
    assert fake_control() == ["start", "get_server_list", "quit"]
    assert not os.path.exists(pipe_dir)


def test_cli_command_killed_by_a_signal(fake_control, tmp_path):
    res = _cli(["--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], tmp_path)
    assert res.returncode == 128 + 15, res.stderr
    assert fake_control()[-1] == "quit"


def test_cli_refusals_exit_1(fake_control, tmp_path):
    res = _cli(["--", str(tmp_path / "no-such-command")], tmp_path)
    assert res.returncode == 127 and "cannot run" in res.stderr
    assert fake_control()[-1] == "quit"
    res = _cli(["--", "true"], tmp_path, {"PATH": str(tmp_path)})
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == f"fa_a2a.tools.mps: {mps.CONTROL_BINARY} is not on PATH (CUDA's MPS " \
                                                  "control daemon, installed with the NVIDIA driver)"
