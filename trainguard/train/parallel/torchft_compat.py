"""The one place trainguard reaches into torchft's internals, and the torchft version it was checked against.

torchft is pinned exactly (``torchft==0.2.0`` in ``pyproject.toml``). Everything else trainguard uses is
torchft's public API: ``Manager`` (``start_quorum``, ``allreduce``, ``errored``, ``report_error``,
``should_commit``, ``current_step``, ``load_state_dict``, ``shutdown``), the reconfigurable process groups
(``ProcessGroupGloo``, ``ProcessGroupBabyNCCL``, their ``abort``) and ``torchft.coordination.LighthouseServer``.
``tests/train/test_elastic.py`` fails if torchft moves what :func:`force_reconfigure` touches.
"""

from __future__ import annotations

from importlib import metadata

from trainguard.errors import TrainguardError

TORCHFT_VERSION = "0.2.0"


def torchft_version() -> str:
    """The installed torchft version ("" when it is not installed)."""
    try:
        return metadata.version("torchft")
    except metadata.PackageNotFoundError:
        return ""


def force_reconfigure(manager) -> None:
    """Make ``manager``'s next quorum build a fresh process group, even if the quorum id did not change.

    torchft (0.2.0) reconfigures its process group only when the lighthouse hands out a new quorum id. After
    we aborted our end of a broken collective the old group is unusable, and a quorum with the same members
    (a collective failed but nobody died) keeps its id. torchft has no public call for this: the manager's
    private ``_quorum_id`` goes back to its initial -1, the value that makes ``_async_quorum`` configure."""
    if not isinstance(getattr(manager, "_quorum_id", None), int):
        raise TrainguardError(f"torchft {torchft_version() or '?'}: Manager has no integer _quorum_id; trainguard "
                              f"was checked against torchft {TORCHFT_VERSION} (see trainguard.train.parallel.torchft_compat)")
    manager._quorum_id = -1
