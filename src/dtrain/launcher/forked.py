"""Forked ranks: start a function in child processes whose output goes to pipes, print
that output line by line while they run, collect what each sends back, and stop them.

`dtrain.launch` (notebook.py) runs a function that may exist only in this process's
memory (a notebook cell, ``__main__``, a script read from standard input), so its ranks
are forked, not spawned: they inherit the function instead of importing it. No thread is
used: the parent waits on every pipe at once with `selectors` in the caller's thread, so
a KeyboardInterrupt lands where the children are stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn, TextIO

from dtrain.launcher.lifeline import LAUNCHER_PID, die_with_launcher
from dtrain.process import teardown

GRACE_S = 5.0
"""Seconds a rank has to end after SIGTERM before it gets SIGKILL."""
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


@dataclass
class Child:
    """One forked rank, as the parent sees it."""

    rank: int
    pid: int
    result_fd: int
    streams: dict[int, TextIO]
    """The child's stdout and stderr pipes, each mapped to where its lines are printed."""
    buffers: dict[int, bytearray] = field(default_factory=dict)
    result: bytes | None = None
    """What the child sent back, once it has ended (None: it sent nothing)."""
    status: int | None = None
    """Exit code once reaped (negative: killed by that signal); None while it runs."""
    stopped: bool = False
    """True if the parent signalled it before it had sent anything back."""

    @property
    def fds(self) -> list[int]:
        """The pipes the parent still has open for this child."""
        return [fd for fd in (self.result_fd, *self.streams) if fd >= 0]


def fork_rank(
    rank: int, env: dict[str, str], run: Callable[[], bytes], others: list[Child]
) -> Child:
    """Fork rank `rank`. The child sets `env`, sends its fds 0-2 to /dev/null and two
    pipes, calls `run`, writes the bytes it returns to a third pipe and exits; it never
    returns from here. `others` are the ranks forked before, whose pipes it closes."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    result_r, result_w = os.pipe()
    env = {**env, LAUNCHER_PID: str(os.getpid())}  # the child dies with this process
    pid = os.fork()
    if pid == 0:
        inherited = [fd for child in others for fd in child.fds]
        _child(env, run, out_w, err_w, result_w, [out_r, err_r, result_r, *inherited])
    for fd in (out_w, err_w, result_w):
        os.close(fd)
    return Child(rank, pid, result_r, {out_r: sys.stdout, err_r: sys.stderr})


def _child(
    env: dict[str, str],
    run: Callable[[], bytes],
    out_w: int,
    err_w: int,
    result_w: int,
    closing: list[int],
) -> NoReturn:
    # Engines open in the parent are the parent's to close, not this copy's.
    teardown.forget_all()
    try:
        for fd in closing:
            os.close(fd)
        _redirect(out_w, err_w)
        os.environ.update(env)
        die_with_launcher()
        payload = run()
        with open(result_w, "wb") as pipe:
            pipe.write(payload)
    except BaseException:  # noqa: BLE001 - the parent reports an exit without a result
        teardown.exit_now(1)
    # exit_now closes what the function left open (an Engine: its process group) and
    # leaves with os._exit: the parent's atexit handlers and copied buffers stay untouched.
    teardown.exit_now(0)


def _redirect(out_w: int, err_w: int) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (out_w, 1), (err_w, 2)):
        os.dup2(source, target)
        os.close(source)
    # New Python streams over fds 0-2: a notebook's sys.stdout is the kernel's object, with
    # no file descriptor and threads that did not survive the fork.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stdout, sys.stderr = (
        open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        for fd in (1, 2)
    )


def watch(children: list[Child], timeout: float | None, failed: Callable[[Child], bool]) -> bool:
    """Print the children's output as it comes, prefixed ``[rank N]``, and collect what
    they send back until every child has ended. When `failed` says a child failed, or
    `timeout` seconds pass, the others get SIGTERM, then SIGKILL after GRACE_S.

    Returns:
        True if the timeout expired first.
    """
    selector = selectors.DefaultSelector()
    for child in children:
        for fd in child.fds:
            selector.register(fd, selectors.EVENT_READ, child)
    deadline = None if timeout is None else time.monotonic() + timeout
    kill_at: float | None = None
    timed_out = False
    try:
        while any(child.status is None for child in children):
            for key, _ in selector.select(0.1):
                _read(key.data, key.fd, selector)
            _reap(children, selector)
            now = time.monotonic()
            if kill_at is None and any(failed(child) for child in children):
                kill_at = _terminate(children)
            elif kill_at is None and deadline is not None and now > deadline:
                timed_out, kill_at = True, _terminate(children)
            elif kill_at is not None and now > kill_at:
                _signal(children, signal.SIGKILL)
    finally:
        selector.close()
    return timed_out


def end(children: list[Child]) -> None:
    """Stop every child still running (SIGTERM, then SIGKILL after GRACE_S), reap it, and
    close the parent's pipes. Safe to call again, and after a KeyboardInterrupt."""
    running = [child for child in children if child.status is None]
    _terminate(running)
    deadline = time.monotonic() + GRACE_S
    try:
        while any(child.status is None for child in running) and time.monotonic() < deadline:
            _reap(running, None)
            time.sleep(0.05)
    finally:
        _signal(running, signal.SIGKILL)
        for child in running:
            if child.status is None:
                child.status = os.waitstatus_to_exitcode(os.waitpid(child.pid, 0)[1])
        for child in children:
            for fd in child.fds:
                _close(child, fd, None)


def _read(child: Child, fd: int, selector: selectors.BaseSelector | None) -> bool:
    """Read what `fd` holds now; False once it is at its end (then closed)."""
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return False
    if not data:
        _close(child, fd, selector)
        return False
    buffer = child.buffers.setdefault(fd, bytearray())
    buffer += data
    if fd in child.streams:
        _print_lines(child, fd, final=False)
    return True


def _print_lines(child: Child, fd: int, final: bool) -> None:
    """Print the complete lines of `fd`'s buffer (all of it if `final`). A line ending in
    a carriage return (a progress bar) is printed with it, so it overwrites as it would;
    a bare carriage return (a bar's redraw starts with one) is dropped, since printing it
    would leave a lone ``[rank N]`` before the next line's own."""
    buffer = child.buffers.get(fd, bytearray())
    lines = _LINE.findall(buffer)
    done = sum(map(len, lines))
    if done == len(buffer) and buffer.endswith(b"\r") and not final:
        lines, done = lines[:-1], done - len(lines[-1])  # may be the first half of \r\n
    if final and done < len(buffer):
        lines.append(bytes(buffer[done:]) + b"\n")
        done = len(buffer)
    del buffer[:done]
    stream = child.streams[fd]
    lines = [line for line in lines if line != b"\r"]
    for line in lines:
        stream.write(f"[rank {child.rank}] {line.decode('utf-8', 'replace')}")
    if lines:
        stream.flush()


def _close(child: Child, fd: int, selector: selectors.BaseSelector | None) -> None:
    if selector is not None:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(fd)
    if fd == child.result_fd:
        child.result = bytes(child.buffers.pop(fd, b"")) or None
        child.result_fd = -1
    else:
        _print_lines(child, fd, final=True)
        del child.streams[fd]
    os.close(fd)


def _reap(children: list[Child], selector: selectors.BaseSelector | None) -> None:
    """Record the exit of every child that ended, and take what its pipes still hold: all
    it wrote is there, since a write that does not fit keeps the writer alive."""
    for child in children:
        if child.status is not None:
            continue
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid == 0:
            continue
        child.status = os.waitstatus_to_exitcode(status)
        for fd in child.fds:
            os.set_blocking(fd, False)
            while _read(child, fd, selector):
                pass
            if fd in child.fds:  # a process the child started still holds it open
                _close(child, fd, selector)


def _terminate(children: list[Child]) -> float:
    """SIGTERM every running child; return when SIGKILL is due."""
    for child in children:
        if child.status is None and child.result_fd >= 0:
            child.stopped = True
    _signal(children, signal.SIGTERM)
    return time.monotonic() + GRACE_S


def _signal(children: list[Child], signum: int) -> None:
    for child in children:
        if child.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)
