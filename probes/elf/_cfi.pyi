"""Types of the reader of call-frame information (probes/elf/cfi_rows.c)."""

def rows(eh_frame: bytes, eh_frame_address: int, debug_frame: bytes) -> tuple[bytes, int, int, int]:
    """(rows packed as cfi.ROW, FDEs read, FDEs skipped, FDEs malformed)."""
