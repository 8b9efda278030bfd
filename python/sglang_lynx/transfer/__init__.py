"""Transfer layer below SGLang (no sglang imports): moves per-request anchor/residual byte buffers from a
prefill process into registered staging memory of a decode process through Mooncake.

- ``mooncake_engine``  the only ``mooncake`` import: typed, checked wrapper (P2PHANDSHAKE, tcp)
- ``scheduler``        two-priority sender: anchors first, residual chunked + windowed, encode overlap
- ``progress``         per-request/per-stream states, futures, events on the sending side
- ``streams``          stream descriptors, crc32, validation of remote metadata before any write
- ``staging``          decode-side arena allocator with quarantine after failures
- ``receiver``         decode-side progress: anchor landed, residual landed, failed (which stream, why)
- ``control``          control notices (landed / failed / quiet) over ZMQ, per-peer sockets, bounded sends
- ``health``           guarded threads: errors counted and logged, a stopped thread reported as unhealthy
- ``link``             link emulation: netns + veth + tc tbf, or an application pacer

Importing this package does not import ``mooncake``; ``MooncakeEngine(...)`` does.
"""

from sglang_lynx.transfer.link import Link, LinkKind, TokenBucketPacer, open_link
from sglang_lynx.transfer.progress import (
    EncodedObject,
    LocalBuffer,
    RequestTransfer,
    StreamEvent,
    StreamFailure,
    TransferState,
)
from sglang_lynx.transfer.receiver import InboundRequest, InboundState, ReceiveTracker
from sglang_lynx.transfer.scheduler import SchedulerParams, TransferScheduler
from sglang_lynx.transfer.staging import StagingAllocator, StagingFullError, StagingLease
from sglang_lynx.transfer.streams import (
    ChecksumMismatchError,
    RemoteTarget,
    StreamDescriptor,
    StreamKind,
    StreamRegion,
    TransferMetadataError,
    validate_target,
)

__all__ = [
    "ChecksumMismatchError", "EncodedObject", "InboundRequest", "InboundState", "Link", "LinkKind",
    "LocalBuffer", "ReceiveTracker", "RemoteTarget", "RequestTransfer", "SchedulerParams",
    "StagingAllocator", "StagingFullError", "StagingLease", "StreamDescriptor", "StreamEvent",
    "StreamFailure", "StreamKind", "StreamRegion", "TokenBucketPacer", "TransferMetadataError",
    "TransferScheduler", "TransferState", "open_link", "validate_target",
]
