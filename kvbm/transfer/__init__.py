"""How bytes move: memory-to-memory copies and block-file I/O, each with a NIXL and a plain backend.

``TransferConfig.backend`` picks the implementation: ``"nixl"`` requires NIXL (UCX for memory,
POSIX for files) and raises :class:`TransferBackendError` when it is missing; ``"plain"`` uses torch
``copy_`` and ``os.pwritev``/``os.preadv``; ``"auto"`` (the default) takes the plain paths, which measured
as fast or faster in-process (see ``make_memory_mover`` and ``make_file_io``).

Block files are ``header || payload`` (see :mod:`kvbm.blocks`). With O_DIRECT the header is a whole
number of pages (4096), the payload starts at that offset and is padded with zeros to a page multiple;
the true payload length lives in the header. Filesystems that refuse O_DIRECT (EINVAL) fall back to
buffered I/O; ``FileIO.modes`` counts which mode each write and read ran in.

Modules: ``nixl_agent`` (the NIXL probe, agents and transfer wait), ``memory`` (memory movers),
``aligned`` (page alignment, scratch buffers), ``fileio`` (block-file readers/writers).
"""

from kvbm.transfer.aligned import O_DIRECT, PAGE, round_up
from kvbm.transfer.fileio import FileIO, NixlFileIO, PlainFileIO, make_file_io
from kvbm.transfer.memory import MemoryMover, NixlMemoryMover, TorchMemoryMover, make_memory_mover
from kvbm.transfer.nixl_agent import TransferBackendError, nixl_available

__all__ = [
    "O_DIRECT",
    "PAGE",
    "FileIO",
    "MemoryMover",
    "NixlFileIO",
    "NixlMemoryMover",
    "PlainFileIO",
    "TorchMemoryMover",
    "TransferBackendError",
    "make_file_io",
    "make_memory_mover",
    "nixl_available",
    "round_up",
]
