"""Wire protocol: one module per channel with its immutable message structs and kind enum.

No behaviour lives here (encoding is `slipstream.runtime.codec`). Every struct is keyword-only,
frozen and array-like: the body is a MessagePack array in field order, so field order *is* the wire
format and the golden-bytes tests pin it. Adding a field means bumping PROTOCOL_VERSION.
"""

from slipstream.protocols.base import PROTOCOL_VERSION, Message

__all__ = ["PROTOCOL_VERSION", "Message"]
