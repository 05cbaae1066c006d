"""The one error hierarchy of mtrace-live, at the bottom layer so that
every layer raises these classes and none translates another's.

Library code raises these; only ``cli.main`` turns them into a single
``mtrace-live: error: ...`` line and the exit code below. Codes are stable and
documented in docs/exit-codes.md.
"""

from __future__ import annotations


class MtraceError(Exception):
    """Base class; ``exit_code`` is what the command-line tool exits with."""

    exit_code = 1


class NotPrivilegedError(MtraceError):
    """Not root, or lacking CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN."""

    exit_code = 3


class BccUnavailableError(MtraceError):
    """The distro's bcc Python bindings cannot be imported."""

    exit_code = 4


class NoProbesError(MtraceError):
    """The target libc carries no SDT probes (built without --enable-systemtap)."""

    exit_code = 5


class NotGlibcError(NoProbesError):
    """The file is not a glibc whose malloc probes can be derived."""


class TargetError(MtraceError):
    """The target process, command or library does not exist or cannot be read."""

    exit_code = 6


class DebugInfoError(TargetError):
    """A debug file that cannot be used: unreadable, or for another build."""


class UnknownLayoutError(TargetError):
    """A runtime whose memory layout mtrace-live does not know: a CPython
    interpreter it has no frame layout for (3.10 or older, a version past
    its tables, a free-threaded build), or a libc whose thread-specific
    data it cannot place."""


class AttachError(MtraceError):
    """A BPF program failed to compile, load or attach."""

    exit_code = 7


class TracepointMissingError(MtraceError):
    """The running kernel lacks a tracepoint mtrace-live needs."""

    exit_code = 8


class UsageError(MtraceError):
    """The command line asks for something that cannot be done (e.g. no probe matches)."""

    exit_code = 2


class NotElfError(MtraceError):
    """A file that should be ELF is not, or is truncated."""

    exit_code = 9


class MalformedNoteError(MtraceError):
    """An ELF file whose SDT notes do not parse."""

    exit_code = 10


class TargetExecError(MtraceError):
    """The traced process exec'd another program: its allocator state is gone."""

    exit_code = 11


class OutputClosedError(MtraceError):
    """The reader of the event output went away (e.g. ``| head``)."""

    exit_code = 12


class NoMatchingProbeError(MtraceError):
    """No probe of the libc matches the --probes patterns."""

    exit_code = 13


class RecordSetError(MtraceError):
    """A kmemtrace record set that cannot be read at all: not a record set, a
    missing or unknown abi_version, a missing cpuN file."""

    exit_code = 14


class DamagedRecordsError(MtraceError):
    """Records were read, but a file is damaged (truncated, a bad event size)."""

    exit_code = 15


class ListenError(MtraceError):
    """The metrics endpoint cannot listen: address in use, not permitted, malformed."""

    exit_code = 16


class WebConfigError(MtraceError):
    """The --web.config.file is unreadable or invalid (TLS files, auth hashes, keys)."""

    exit_code = 17


class PrivilegeDropError(MtraceError):
    """The user to run as after attaching does not exist or cannot be switched to."""

    exit_code = 18


class SpRtraceError(MtraceError):
    """Text that is not an sp-rtrace report, or a malformed record in one."""

    exit_code = 19


class OutputError(MtraceError):
    """An output file (--pprof) cannot be written."""

    exit_code = 20


class InternalError(MtraceError):
    """A fault of mtrace-live's own while tracing (a bug): the trace ends as
    any other does (every held process continued, the probes detached, the
    outputs written as far as they got), then says where, in one line."""

    exit_code = 21

    @classmethod
    def during(cls, what: str, exc: BaseException) -> InternalError:
        frame = exc.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        where = (f" at {frame.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.tb_lineno}"
                 if frame is not None else "")  # fmt: skip
        return cls(f"internal error while {what}: {type(exc).__name__}: {exc}{where}; "
                   "please report it")  # fmt: skip
