"""JSON request bodies of the HTTP door: decoded by msgspec into a struct, or refused naming the
field (`Rejected`), the value msgspec quotes cut and the choices of a Literal field named."""
from __future__ import annotations

import re
from typing import Literal, get_args, get_origin

import msgspec

from pollen.common.errors import ECHO_CHARS, cut

_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
# msgspec's own words around a value it quotes are short: a longer message is a long value quoted.
_MSGSPEC_CHARS = 60 + ECHO_CHARS


class Rejected(Exception):
    """A request the door refuses before it reaches the service."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def choices(struct: type) -> dict[str, tuple]:
    """The choices of each Literal field (`Literal[...] | None` and a list of them included), named
    in refusals."""
    def literals(t) -> list:
        return [t] if get_origin(t) is Literal else [a for arg in get_args(t) for a in literals(arg)]

    return {f.name: get_args(found[0]) for f in msgspec.structs.fields(struct) if (found := literals(f.type))}


def decode(decoder: msgspec.json.Decoder, data: bytes, field_choices: dict[str, tuple]):
    """The body as the decoder's struct; Rejected with the parser's reason when it is not."""
    # The Content-Type is not checked: the body must parse as JSON whatever it says (curl's -d
    # sends form-urlencoded), and a body that does not is refused with the parser's reason.
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _AT_PATH.search(text)
        param = match.group(1) if match else None
        # msgspec quotes the bad value (an enum value, an unknown field's name) whole: cut it.
        text = cut(text[:match.start()], _MSGSPEC_CHARS) + match.group() if match else cut(text, _MSGSPEC_CHARS)
        field = re.sub(r"\[\d+\]$", "", param or "")  # a list's item (outputs[0]) has its list's choices
        if field in field_choices:  # msgspec names the bad value; name the good ones too
            text += f" (one of: {', '.join(field_choices[field])})"
        raise Rejected(f"invalid request body: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise Rejected(f"the body is not valid JSON: {cut(str(exc), _MSGSPEC_CHARS)}") from None
