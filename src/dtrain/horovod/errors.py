"""The errors `dtrain.horovod` raises, typed as Horovod's are so that scripts catching
them keep working: a call before `init()` is a ValueError, a refused feature a
NotImplementedError, a failed collective a `HorovodInternalError` (a RuntimeError)."""

from __future__ import annotations

from dtrain.errors import DtrainError


class NotInitializedError(DtrainError, ValueError):
    """A Horovod call that needs the process group came before `hvd.init()`."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"hvd.{what}() needs Horovod's process group, which is not set up yet; call "
            "hvd.init() once at the start of the script, before any other hvd call."
        )


class HorovodUsageError(DtrainError, ValueError):
    """An argument Horovod's API does not accept (an unknown op, mismatched shapes...)."""


class UnsupportedError(DtrainError, NotImplementedError):
    """A Horovod feature this version of dtrain does not offer; the message says what to
    use instead."""


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died, a timeout passed); Horovod's elastic scripts
    catch this name."""


class MismatchError(HorovodUsageError, HorovodInternalError):
    """The processes disagree about an operation of one name (shape, dtype, op, root...).
    Raised on every process that issued it; both a ValueError (a usage error, as dtrain
    reports them) and a HorovodInternalError (what Horovod raises for it)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises this from `state.commit()` when hosts were added or removed, to bring
    every worker back to `hvd.elastic.run`'s sync point. dtrain never raises it: a change of
    machines restarts the worker group instead (see docs/horovod.md, "Elastic training");
    it exists so that scripts naming it import and run unchanged."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("The hosts of the job changed; the workers meet again.")
        self.skip_sync = skip_sync


class PeerLostError(DtrainError):
    """`hvd.elastic.run`: a collective failed inside the training function (a peer died);
    this process ends so that the launcher restarts the group from the last commit."""
