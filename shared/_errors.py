"""The one exception the wire codec raises."""

__all__ = ["SnapshotError"]


class SnapshotError(ValueError):
    """A snapshot could not be encoded, decoded, verified or accepted.

    Every failure of the codec, whatever its cause (garbage bytes, a bad field, a wrong signature,
    a stale or replayed snapshot), is reported as this one type so that callers need one handler.
    """
