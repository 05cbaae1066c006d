"""The kinds of a stored frame (records.h, "frame kinds"): a u64 whose top
bits say what it is. An address in its process (kind 0, the frames found
by frame pointers), a return address in a file by the file's number and
its link-time address there (the frames the CFI walk found in a file the
trace numbered), which names itself without its process's maps, or a
Python function's frame by its code object and instruction offset.
"""

from __future__ import annotations

from .program import c_constants
from .records import header_path

_DEFINES = c_constants(header_path().read_text())
KIND_SHIFT = _DEFINES["FRAME_KIND_SHIFT"]
KIND_ADDRESS = _DEFINES["FRAME_KIND_ADDRESS"]
KIND_FILE = _DEFINES["FRAME_KIND_FILE"]
KIND_PYTHON = _DEFINES["FRAME_KIND_PYTHON"]
KIND_NAMES = {KIND_ADDRESS: "address", KIND_FILE: "file", KIND_PYTHON: "python"}
# An address (kind 0) that lies in anonymous executable memory of its
# process: JIT code. Not a stored kind: told when the frame is named.
JIT_NAME = "jit"
PYTHON_SHIFT = _DEFINES["FRAME_PYTHON_SHIFT"]
FILE_SHIFT = _DEFINES["FRAME_FILE_SHIFT"]
FILE_NUMBERS = _DEFINES["FRAME_FILE_NUMBERS"]
KERNEL_NUMBERS = _DEFINES["FRAME_KERNEL_NUMBERS"]  # the kernel's below, the trace's from here
_ADDRESS_MASK = (1 << FILE_SHIFT) - 1


def frame_kind(frame: int) -> int:
    return frame >> KIND_SHIFT


def file_frame(number: int, address: int) -> int:
    """The frame at link-time ``address`` of file ``number``."""
    return (KIND_FILE << KIND_SHIFT) | (number << FILE_SHIFT) | address


def file_base(number: int) -> int:
    """Where file ``number``'s link-time address 0 is among frame values:
    the file as if it were mapped there, for tools that read mappings."""
    return file_frame(number, 0)


def in_file(frame: int) -> tuple[int, int] | None:
    """(file number, link-time address) of a frame in a file, else None."""
    if frame >> KIND_SHIFT != KIND_FILE:
        return None
    return (frame >> FILE_SHIFT) & (FILE_NUMBERS - 1), frame & _ADDRESS_MASK


def python_frame(code: int, offset: int) -> int:
    """The frame of the instruction at ``offset`` (code units) of the code
    object at ``code`` (8-byte aligned)."""
    return (KIND_PYTHON << KIND_SHIFT) | (code >> 3 << PYTHON_SHIFT) | offset


def in_python(frame: int) -> tuple[int, int] | None:
    """(code object's address, instruction offset) of a Python frame, else None."""
    if frame >> KIND_SHIFT != KIND_PYTHON:
        return None
    return (frame & ((1 << KIND_SHIFT) - 1)) >> PYTHON_SHIFT << 3, frame & ((1 << PYTHON_SHIFT) - 1)
