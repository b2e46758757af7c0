"""Error types of the cache library.

Every error a caller can act on has its own type. Input errors subclass
``ValueError`` so generic callers (HTTP layers, argparse) can map them to a
client error without knowing this library.
"""


class CacheError(Exception):
    """Base class for every error raised by the cache library."""


class InvalidInputError(CacheError, ValueError):
    """The caller passed something malformed: bad tokens, bad extents, bad config."""


class PoolExhaustedError(CacheError, MemoryError):
    """A pool has no room left for an allocation, even after eviction.

    Raised before anything is allocated, so the pool is unchanged and the caller
    can evict, demote or recompute and try again.
    """

    def __init__(self, message: str, *, needed_blocks: int = 0, free_blocks: int = 0):
        super().__init__(message)
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class DiskTierError(CacheError, OSError):
    """The disk tier cannot be used: missing or unwritable directory, bad file."""


class ChecksumError(CacheError):
    """A block read back from a tier does not match the checksum stored with it."""
