"""What a failed job tells the user: the rendezvous that did not come together, the host
that holds it lost, and every failed rank with its exit code or signal and its own
traceback (torch's elastic agent reports the failures; these turn them into sentences)."""

from __future__ import annotations

import signal
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from dtrain.config import Config
from dtrain.launch.stacks import where


def rendezvous_failed(config: Config, error: Exception) -> str:
    """What to do when the nodes' agents did not all meet at the rendezvous in time."""
    text = str(error).strip()
    first_line = text.splitlines()[0].rstrip(".") if text else type(error).__name__
    if config.min_nnodes is not None and isinstance(error, RendezvousConnectionError):
        cause = str(error.__cause__ or "").strip()  # torch's own text says "see inner"
        first_line = cause.splitlines()[0].rstrip(".") if cause else first_line
        # This machine reached the rendezvous before its workers started (addressing.locate
        # waits for it), so losing the connection now means its host went away.
        return rendezvous_host_lost(config, first_line)
    if config.min_nnodes is not None:
        return (
            f"Fewer than {config.min_nnodes} machines met at the rendezvous at {config.master} "
            f"within {config.timeout_s:g} s ({first_line}). Start the same command on at "
            f"least {config.min_nnodes} machines, the machine that holds the --master address "
            "among them, check that they can reach it at that port, or raise --timeout."
        )
    others = "1" if config.nnodes == 2 else f"1 to {config.nnodes - 1}"
    if config.node_rank == 0:
        return (
            f"Node 0 hosted the rendezvous at {config.master} for {config.timeout_s:g} s, "
            f"but not all {config.nnodes} nodes joined ({first_line}). Start the same command "
            f"on each other machine with its own --node-rank ({others}) and the same "
            "--master, check that they can reach this machine at that address and port (no "
            "firewall between them), or raise --timeout."
        )
    return (
        f"Node {config.node_rank} lost the rendezvous at {config.master} ({first_line}): "
        "node 0 stopped or became unreachable. Its own output says why; start every node "
        "again once it is fixed."
    )


def rendezvous_host_lost(config: Config, why: str) -> str:
    """An elastic job's machine lost the machine that hosts its rendezvous."""
    return (
        f"The machine hosting the rendezvous at {config.master} (the one that holds the "
        f"--master address) stopped or became unreachable ({why}), so this machine stops "
        "too: an elastic job survives losing any machine but that one. Start the command "
        "again on every machine once it is back; a script that resumes from its last "
        "checkpoint continues from there."
    )


def _causes(failures: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """The failures that ended the job: not the ranks the agent stopped (SIGTERM) after."""
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    return {r: f for r, f in failures.items() if r not in stopped} or failures


def exit_code_of(failures: dict[int, ProcessFailure]) -> int:
    """The job's exit code: the failed ranks' own (`sys.exit(3)` on every rank gives 3)
    when they agree on one, else 1 (a rank killed by a signal included)."""
    codes = {f.exitcode for f in _causes(failures).values()}
    return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1


TIMED_OUT = (
    "It waited longer than --timeout in a collective operation for a rank that never took "
    "part: that rank hung or died. The ranks below that were still running show where "
    "they were; raise --timeout only if a rank is just slow (a long first step, a big "
    "checkpoint)."
)


def _timed_out(detail: str) -> bool:
    """Whether a rank's traceback ends in a collective's timeout (gloo's or NCCL's)."""
    last = detail.strip().splitlines()[-1] if detail.strip() else ""
    return "Timed out waiting" in last or ("timed out" in last.lower() and "Watchdog" in last)


def format_failures(
    failures: dict[int, ProcessFailure],
    role: Callable[[int], str] | None = None,
    stacks: dict[int, str] | None = None,
    finished: dict[int, float] | None = None,
) -> str:
    """One paragraph per failed rank: how it ended and its own traceback or message.

    `role` names what a rank does where the strategy gives ranks roles ("server 0").

    When one rank fails the agent stops the others with SIGTERM; those are listed last,
    so the rank that caused the failure stands first, each with where it was (`stacks`:
    the Python stacks they wrote when stopped), which names a rank that hung; ranks that
    had already finished their script (`finished`: when) are named too, since the others
    may have waited for them.
    """
    causes = _causes(failures)
    reports: dict[tuple[str, str], list[int]] = {}
    for rank, failure in sorted(causes.items()):
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        ours = data.get("dtrain")
        if failure.exitcode < 0:
            how = f"was killed by signal {failure.signal_name()}"
            detail = (
                "It raised no Python exception: it was killed from outside or ran out of "
                "memory; check the machine's logs (dmesg) and its memory use."
            )
        else:
            how = f"exited with code {failure.exitcode}"
            if ours:
                detail = ours["message"] if ours["user_error"] else ours["traceback"].rstrip()
            else:
                detail = "It left no traceback; its own output above shows why it stopped."
            if _timed_out(detail):
                detail = f"{detail}\n{TIMED_OUT}"
        reports.setdefault((how, detail), []).append(rank)
    parts = []
    for (how, detail), ranks in reports.items():
        if len(ranks) == 1:
            rank, failure = ranks[0], causes[ranks[0]]
            what = f"{role(rank)}, " if role is not None and role(rank) != f"rank {rank}" else ""
            who = f"Rank {rank} ({what}local rank {failure.local_rank}, pid {failure.pid})"
        else:
            who = f"Ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} {how}:\n{detail}")
    others = sorted(set(failures) - set(causes))
    stacks = stacks or {}
    located = {r: where(stacks[r]) for r in others if r in stacks}
    located = {r: frames for r, frames in located.items() if frames}
    for rank, frames in located.items():
        parts.append(
            f"Rank {rank} was still running when the launcher stopped it, here (most recent "
            f"call first):\n{frames}"
        )
    quiet = [r for r in others if r not in located]
    if quiet:
        parts.append(
            f"Rank(s) {', '.join(map(str, quiet))} were stopped by the launcher after that."
        )
    done = sorted(r for r in finished or {} if r not in failures)
    if done:
        parts.append(
            f"Rank(s) {', '.join(map(str, done))} had already finished their script (exit "
            "code 0) while the others went on: a rank that skips a collective the others run "
            "(fewer steps, an early return or break) leaves them waiting until --timeout. "
            "Every rank must run the same training steps (drop_last=True, the same step "
            "count on every rank)."
        )
    return "\n\n".join(parts)
