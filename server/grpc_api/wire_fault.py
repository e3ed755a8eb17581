"""Where a request's bytes stop being a valid message: the field a refusal names.

protobuf's parser says only what went wrong ("Wire format was corrupt", "String field had bad
UTF-8"), not where. When a message fails to decode, its top-level fields are walked once more
here, by the wire format's own rules, to find the first field whose bytes are at fault: a tag or a
length that runs past the end, an unknown wire type, a string that is not UTF-8, a nested message
that does not decode. Runs only for a message that already failed, so it costs a good request
nothing.
"""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass

_FIXED = {1: 8, 5: 4}  # wire types of fixed width: 64-bit, 32-bit


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def bad_field(message_type, data: bytes) -> str | None:
    """The first top-level field of `message_type` whose bytes in `data` are at fault (`texts[2]`,
    `id`, `field 9` for a number the type does not have), or None when none is."""
    fields = message_type.DESCRIPTOR.fields_by_number
    seen: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        tag = _varint(data, pos)
        if tag is None:
            return None  # the last bytes are no whole tag: no field to name
        key, pos = tag
        number, wire = key >> 3, key & 7
        field = fields.get(number)
        name = field.name if field is not None else f"field {number}"
        index = seen.get(number, 0)
        seen[number] = index + 1
        if field is not None and field.is_repeated:
            name = f"{name}[{index}]"
        if number == 0:
            return "a field numbered 0"
        if wire == 0:
            end = _varint(data, pos)
            if end is None:
                return name
            pos = end[1]
        elif wire in _FIXED:
            pos += _FIXED[wire]
            if pos > len(data):
                return name
        elif wire == 2:
            size = _varint(data, pos)
            if size is None or size[1] + size[0] > len(data):
                return name
            chunk, pos = data[size[1]:size[1] + size[0]], size[1] + size[0]
            if field is not None and not _valid(field, chunk):
                return name
        else:  # groups (3, 4) and the unused 6, 7
            return name
    return None


def _valid(field: FieldDescriptor, chunk: bytes) -> bool:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return False
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        try:
            GetMessageClass(field.message_type).FromString(chunk)
        except Exception:  # noqa: BLE001 - whatever bad bytes raise
            return False
    return True
