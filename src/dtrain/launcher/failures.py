"""What a failed job tells the user: the rendezvous that did not come together, the host
that holds it lost, and every failed rank with its exit code or signal and its own
traceback (torch's elastic agent reports the failures; these turn them into sentences),
the cause first (a rank killed, a rank that hung), with the machine it lost its
connection to, by name, address and ranks, where one was lost."""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Callable, Collection

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from dtrain import advice
from dtrain.config import Config
from dtrain.launcher.machines import Survey
from dtrain.launcher.stacks import where


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
        f"again on every machine once it is back; {advice.how_to_resume()}."
    )


def _causes(
    failures: dict[int, ProcessFailure], dumped: Collection[int] = ()
) -> dict[int, ProcessFailure]:
    """The failures that ended the job: not the ranks the agent stopped (SIGTERM) after,
    nor those that wrote their stack on its SIGTERM (`dumped`): such a rank, stopped
    while its main thread still ran (continued from SIGSTOP, the signal taken by another
    thread), can reach a collective with a rank already gone and exit with that error
    before the signal ends it."""
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    stopped |= set(dumped)
    return {r: f for r, f in failures.items() if r not in stopped} or failures


def exit_code_of(failures: dict[int, ProcessFailure]) -> int:
    """The job's exit code: the failed ranks' own (`sys.exit(3)` on every rank gives 3)
    when they agree on one, else 1 (a rank killed by a signal included)."""
    codes = {f.exitcode for f in _causes(failures).values()}
    return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1


TIMED_OUT = (
    "It waited longer than --timeout in a collective operation for a rank that never took "
    "part: that rank hung or died, and a rank still running when the launcher stopped it "
    "is named first, with where it stood; raise --timeout only if a rank is just slow (a "
    "long first step, a big checkpoint)."
)


def _timed_out(detail: str) -> bool:
    """Whether a rank's traceback ends in a collective's timeout (gloo's or NCCL's)."""
    last = detail.strip().splitlines()[-1] if detail.strip() else ""
    return "Timed out waiting" in last or ("timed out" in last.lower() and "Watchdog" in last)


_PEER_LOST = (
    # gloo's and the store's socket errors
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "No route to host",
    "Network is unreachable",
    # NCCL's
    "remote process exited or there was a network error",
    "ncclRemoteError",
    "NCCL communicator was aborted",
)
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")  # gloo's "[10.0.0.2]:41234"


def _exception_text(detail: str) -> str:
    """The exception's own lines at the end of a traceback (frames are indented)."""
    lines = detail.strip().splitlines()
    start = len(lines)
    while start > 0 and not lines[start - 1].startswith(" "):
        start -= 1
    return "\n".join(lines[start:])


def _peer_lost(detail: str) -> bool:
    """Whether a rank's traceback ends in a collective that lost a peer: a timeout, or a
    connection closed, reset or refused (gloo's, NCCL's or the store's words)."""
    text = _exception_text(detail)
    return _timed_out(detail) or any(words in text for words in _PEER_LOST)


def _machines_silent(survey: Survey, lost_by_rank: bool) -> str:
    """The machines of `survey` that do not answer this one, with what to do: as what a
    rank lost its connection to (`lost_by_rank`), or on their own."""
    silent, one = survey.silent, len(survey.silent) == 1
    listed = " and ".join(f"{m.describe()}, where {m.held()} ran" for m in silent)
    noun, it, does = ("machine", "it", "does") if one else ("machines", "they", "do")
    if lost_by_rank:
        said = f"It lost its connection to {noun} {listed}, which {does} not answer this "
        said += "machine either"
    else:
        said = f"{noun.capitalize()} {listed}, {does} not answer this machine"
    check = "that machine and its" if one else "those machines and their"
    said += (
        f": {it} stopped, froze or lost power, or the network between {it} and this "
        f"machine is down. Check {check} network link, then start the job again."
    )
    if len(survey.others) > 1 and len(silent) == len(survey.others):
        said += " No other machine of the job answers: this machine's own link is the likely cause."
    host = survey.rendezvous
    if host is not None and host in silent:
        return (
            f"{said} No job goes on without {host.describe()}, the machine that hosts the "
            "rendezvous (--master): start the command on every machine once it is back."
        )
    if survey.elastic:
        return (
            f"{said} An elastic job goes on without a machine it loses as long as "
            "--max-restarts allows; raise it to survive more losses."
        )
    rendezvous = "the machine" if host is None else f"{host.describe()}, the machine"
    return (
        f"{said} An elastic job (--nnodes MIN:MAX with --max-restarts 1 or more) goes on "
        f"without a machine it loses, unless that is {rendezvous} that hosts the rendezvous; "
        f"{advice.how_to_resume()}."
    )


def _lost_connection(survey: Survey, detail: str) -> str | None:
    """What a rank that lost a peer adds to its report: the machines that no longer answer
    this one; else the machine at the address its error names, which still answers;
    None if neither."""
    if survey.silent:
        return _machines_silent(survey, lost_by_rank=True)
    found = _PEER_ADDRESS.search(_exception_text(detail))
    machine = survey.at(found.group(1)) if found else None
    if machine is None:
        return None
    return (
        f"It lost its connection to machine {machine.describe()}, where {machine.held()} "
        "ran, which still answers this machine: its ranks stopped (its own output says why), "
        "or the network between them dropped the connection."
    )


def killed_advice() -> str:
    """What a rank killed by a signal (no Python exception of its own) is told."""
    return (
        "It raised no Python exception: it was killed from outside or ran out of memory; "
        "check the machine's logs (dmesg) and its memory use, then start the job again: the "
        f"checkpoints already written are intact ({advice.how_to_resume()})."
    )


def _how(failure: ProcessFailure) -> tuple[str, str]:
    """(how a failed rank ended, its own traceback or message, or what to check)."""
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()}", killed_advice()
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    ours = data.get("dtrain")
    if ours:
        detail = ours["message"] if ours["user_error"] else ours["traceback"].rstrip()
    else:
        detail = "It left no traceback; its own output above shows why it stopped."
    return f"exited with code {failure.exitcode}", detail


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _role(role: Callable[[int], str] | None, rank: int) -> str | None:
    """What `rank` does, where its strategy gives it a role of its own ("server 0")."""
    return role(rank) if role is not None and role(rank) != f"rank {rank}" else None


def _stood(
    located: dict[int, str], waited: list[int], role: Callable[[int], str] | None
) -> list[str]:
    """One paragraph per rank still running when the ranks `waited` timed out waiting for
    another: where it stood (`located`: its frames), the one that hung when it is alone."""
    parts = []
    for rank, frames in located.items():
        does = _role(role, rank)
        named = f"Rank {rank} ({does})" if does else f"Rank {rank}"
        if len(located) == 1:
            lead = (
                f"{named} hung: {_ranks(waited)} waited longer than --timeout for it, and it "
                "was still running when the launcher stopped it"
            )
        else:
            lead = (
                f"{named} was still running when the launcher stopped it, after "
                f"{_ranks(waited)} waited longer than --timeout for one of the ranks still "
                "running"
            )
        parts.append(f"{lead}, here (most recent call first):\n{frames}")
    return parts


def format_failures(
    failures: dict[int, ProcessFailure],
    role: Callable[[int], str] | None = None,
    stacks: dict[int, str] | None = None,
    survey: Survey | None = None,
    finished: dict[int, float] | None = None,
) -> str:
    """One paragraph per failed rank: how it ended and its own traceback or message, the
    cause first.

    `role` names what a rank does where the strategy gives ranks roles ("server 0").

    When one rank fails the agent stops the others with SIGTERM; those are no cause. Of
    the ranks that failed on their own, one killed by a signal (SIGKILL, the kernel's
    out-of-memory killer) comes first, then those with an error of their own, then
    those whose error only says that they lost a peer, which follows from the others.
    When a rank timed out waiting for another, the stopped ranks lead, each with where it
    was (`stacks`: the Python stacks they wrote when stopped), which names the rank that
    hung; otherwise a stopped rank was only stopped after the failure (every rank raising
    the same refusal, say) and its stack would read as a hang, so it is listed in one
    line. Ranks that had already finished their script (`finished`: when) are named too,
    since the others may have waited for them.

    A job of several machines passes what this machine found out about the others
    (`survey`): a rank that lost a peer is told which machine that was, and a machine
    that does not answer any more is named even when no rank's error points to it.
    """
    causes = _causes(failures, stacks or {})
    host = socket.gethostname()
    lost_told = False
    ordered: list[tuple[int, int, str, str]] = []
    waited: list[int] = []
    for rank, failure in causes.items():
        how, detail = _how(failure)
        order = 0 if failure.exitcode < 0 else 1
        if failure.exitcode >= 0 and _peer_lost(detail):
            order, timed_out = 2, _timed_out(detail)
            waited += [rank] if timed_out else []
            lost = _lost_connection(survey, detail) if survey else None
            if lost:
                detail = f"{detail}\n{lost}"
                lost_told = lost_told or bool(survey and survey.silent)
            elif timed_out:
                detail = f"{detail}\n{TIMED_OUT}"
        ordered.append((order, rank, how, detail))
    reports: dict[tuple[str, str], list[int]] = {}
    for _, rank, how, detail in sorted(ordered):
        reports.setdefault((how, detail), []).append(rank)
    parts = []
    for (how, detail), ranks in reports.items():
        if len(ranks) == 1:
            rank, failure = ranks[0], causes[ranks[0]]
            does = _role(role, rank)
            what = f"{does}, " if does else ""
            who = f"Rank {rank} ({what}local rank {failure.local_rank}, pid {failure.pid}, "
            who += f"host {host})"
        else:
            who = f"Ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} {how}:\n{detail}")
    if survey is not None and survey.silent and not lost_told:
        parts.append(_machines_silent(survey, lost_by_rank=False))
    others = sorted(set(failures) - set(causes))
    # Only a rank that timed out waiting makes the stopped ranks' stacks a hang's.
    located = {r: where(stacks[r]) for r in others if waited and stacks and r in stacks}
    located = {r: frames for r, frames in located.items() if frames}
    parts = _stood(located, sorted(waited), role) + parts
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
            "(fewer steps, an early return or break) leaves them waiting until --timeout, or "
            "failing as soon as its connection closes. "
            "Every rank must run the same training steps (drop_last=True, the same step "
            "count on every rank)."
        )
    return "\n\n".join(parts)
