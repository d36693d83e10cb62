"""Typed protocol messages carried as msgpack, by msgspec.

Every message is a frozen Struct with a unique tag (``class X(Message, tag="area.name")``),
encoded as the map ``{"t": tag, field: value, ...}``, every field in declaration order. Field
types are limited to None, int, float, str, bytes, bool, IntEnum/StrEnum, registered messages,
tuples, ``dict[str, X]`` and ``X | None``, and no field has a default: a missing one is an error.

Decoding is strict (unknown tag, missing or extra field, wrong type, NaN: ProtocolError), and
its errors name the tag and field path but never a value, which may be secret. Encoding decodes
what it encoded and compares, so a field that would not come back equal is refused (BadInput).
A message may have more than one decodable encoding, so whatever is signed as bytes must be
checked by re-encoding (orchestrator/audit/verify.py). ``secret=(...)`` fields stay out of repr.
"""

from __future__ import annotations

import enum
import re
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar, overload

import msgspec
import msgspec.inspect

from gputravel.errors import BadInput, ProtocolError

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest encoded message (and transport frame payload) accepted anywhere."""

TAG_FIELD = "t"

_CLASS_BY_TAG: dict[str, type] = {}
_TAG_BY_CLASS: dict[type, str] = {}
_UNCHECKED: list[type[msgspec.Struct]] = []  # registered, field types not yet resolvable (forward references)
_DECODER: msgspec.msgpack.Decoder[object] | None = None  # over every registered class; None: rebuild
_LOCK = threading.Lock()
_ENCODER = msgspec.msgpack.Encoder()


# ----------------------------------------------------------------------------- registration
class _MessageMeta(msgspec.StructMeta):
    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], *,
                secret: tuple[str, ...] = (), **config: Any) -> type:
        is_message = any(isinstance(b, _MessageMeta) for b in bases)  # not Message itself
        if is_message and not isinstance(config.get("tag"), str):
            raise TypeError(f"message {name} needs tag=\"...\" on its class line")
        if secret:
            namespace = {**_hiding(frozenset(secret)), **namespace}  # a class's own repr wins
        cls = super().__new__(mcls, name, bases, namespace, **config)
        if is_message:
            unknown = set(secret) - set(cls.__struct_fields__)
            if unknown:
                raise TypeError(f"message {name}: secret names no field {sorted(unknown)[0]}")
            register(cls)
        return cls


# For type checkers: a subclass inherits frozen=True (msgspec's own transform has it default off).
@typing.dataclass_transform(frozen_default=True, field_specifiers=(msgspec.field,))
class Message(msgspec.Struct, metaclass=_MessageMeta, frozen=True, forbid_unknown_fields=True,
              tag_field=TAG_FIELD):
    """Base of every wire message: ``class X(Message, tag="area.name", secret=("key",)):``."""


def _hiding(secret: frozenset[str]) -> dict[str, Any]:
    """``__repr__`` and ``__rich_repr__`` that leave the secret fields out."""

    def shown(self: msgspec.Struct) -> list[tuple[str, Any]]:
        return [(n, getattr(self, n)) for n in self.__struct_fields__ if n not in secret]

    def __repr__(self: msgspec.Struct) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in shown(self))})"

    def __rich_repr__(self: msgspec.Struct) -> Any:
        yield from shown(self)

    return {"__repr__": __repr__, "__rich_repr__": __rich_repr__}


_C = TypeVar("_C", bound=type)
_M = TypeVar("_M")
_N = TypeVar("_N")
_O = TypeVar("_O")


def register(cls: _C) -> _C:
    """Register a Struct as a wire message (every :class:`Message` is): for crypto/'s structs,
    which may not import this package, configured as Message is."""
    global _DECODER
    tag = _check_config(cls)
    with _LOCK:
        if tag in _CLASS_BY_TAG:
            raise BadInput(f"message tag {tag!r} already registered by {_CLASS_BY_TAG[tag].__qualname__}")
        if cls in _TAG_BY_CLASS:
            raise BadInput(f"{cls.__qualname__} already registered as {_TAG_BY_CLASS[cls]!r}")
        try:
            _check_fields(cls)  # fail at import time on unsupported field types
        except NameError:
            _UNCHECKED.append(cls)  # a forward reference to a later class: checked before use
        _CLASS_BY_TAG[tag] = cls
        _TAG_BY_CLASS[cls] = tag
        _DECODER = None
    return cls


def _check_config(cls: type) -> str:
    """The tag of a class configured as a message must be; TypeError for any other."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise TypeError(f"a message must be a msgspec Struct, got {cls!r}")
    c, name = cls.__struct_config__, cls.__qualname__
    if not isinstance(c.tag, str) or not c.tag or c.tag_field != TAG_FIELD:
        raise TypeError(f"{name}: a message needs a non-empty str tag in field {TAG_FIELD!r}")
    if not c.frozen:
        raise TypeError(f"message {name} must be frozen")
    if not c.forbid_unknown_fields or c.array_like:
        raise TypeError(f"message {name} must be a map that forbids unknown fields")
    if cls.__struct_defaults__:
        raise TypeError(f"message {name} may not have defaults: a missing field must be an error")
    if cls.__struct_encode_fields__ != cls.__struct_fields__:
        raise TypeError(f"message {name} may not rename fields on the wire")
    return c.tag


def _check_fields(cls: type[msgspec.Struct]) -> None:
    hints = typing.get_type_hints(cls)
    for name in cls.__struct_fields__:
        try:
            _check_hint(hints[name])
        except TypeError as e:
            raise TypeError(f"{cls.__qualname__}.{name}: {e}") from None


def _check_hint(hint: Any) -> None:
    """Refuse (TypeError) any type outside the documented encoding."""
    if hint in (type(None), None, int, float, str, bytes, bool):
        return
    if isinstance(hint, type):
        if issubclass(hint, (enum.IntEnum, enum.StrEnum)):
            return
        if issubclass(hint, msgspec.Struct):
            if hint not in _TAG_BY_CLASS:
                raise TypeError(f"nested struct {hint.__qualname__} must be a registered message")
            return
        raise TypeError(f"unsupported field type {hint.__qualname__}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if len(args) != 2 or type(None) not in args:
            raise TypeError(f"only X | None unions are supported, got {hint!r}")
        return _check_hint(args[0] if args[1] is type(None) else args[1])
    if origin is tuple:
        for arg in args[:1] if len(args) == 2 and args[1] is Ellipsis else args:
            if arg != ():  # tuple[()] spelled the old way
                _check_hint(arg)
        return
    if origin is dict and args and args[0] is str:
        return _check_hint(args[1])
    raise TypeError(f"unsupported field type {hint!r}")


def tag_of(cls: type) -> str:
    try:
        return _TAG_BY_CLASS[cls]
    except KeyError:
        raise BadInput(f"{getattr(cls, '__qualname__', cls)!r} is not a registered message") from None


def registered(tag: str) -> type:
    try:
        return _CLASS_BY_TAG[tag]
    except KeyError:
        raise BadInput(f"no message registered under tag {tag!r}") from None


def _decoder() -> msgspec.msgpack.Decoder[object]:
    decoder = _DECODER
    return decoder if decoder is not None else _build_decoder()


def _build_decoder() -> msgspec.msgpack.Decoder[object]:
    """One decoder over the union of every registered message: the tag picks the class."""
    global _DECODER
    with _LOCK:
        while _UNCHECKED:
            cls = _UNCHECKED[0]
            try:
                _check_fields(cls)
            except (NameError, TypeError):
                # Unusable: unregister it, so that it breaks only itself, not every decode.
                del _CLASS_BY_TAG[_TAG_BY_CLASS.pop(cls)]
                raise
            finally:
                _UNCHECKED.pop(0)
        if _DECODER is None:
            _DECODER = msgspec.msgpack.Decoder(typing.Union[tuple(_CLASS_BY_TAG.values())])
        return _DECODER


# ----------------------------------------------------------------------------- errors without values
_AT = re.compile(r" - at (`key` in )?`\$([^`]*)`$")
_REASONS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    # msgspec names types here (ours, and msgpack's), never values.
    (re.compile(r"Expected `([^`]{1,80})`, got `([^`]{1,40})`"), lambda m: f"expected {m[1]}, got {m[2]}"),
    (re.compile(r"Expected `array` of length (\d+), got (\d+)"), lambda m: f"expected {m[1]} items, got {m[2]}"),
    (re.compile(r"Object missing required field `(\w+)`"), lambda m: f"missing field {m[1]}"),
    # A key, not a value: echoed (a bounded prefix) to debug a sender's schema mismatch.
    (re.compile(r"Object contains unknown field `(.*)`", re.S), lambda m: f"unexpected extra field {m[1][:64]!r}"),
    (re.compile(r"Invalid enum value .*", re.S), lambda m: "value is not a member of the enum"),
    (re.compile(r"Invalid value .*", re.S), lambda m: "wrong message tag"),
)


class _Envelope(msgspec.Struct):
    t: str  # only the tag; every other key is skipped


_PEEK = msgspec.msgpack.Decoder(_Envelope)


def _known_tag(data: bytes | bytearray | memoryview) -> str | None:
    """The message's tag if it is a registered one (slow path: errors only)."""
    try:
        tag = _PEEK.decode(data).t
    except Exception:  # malformed, or nested beyond the recursion limit
        return None
    return tag if tag in _CLASS_BY_TAG else None


def _explain(data: bytes | bytearray | memoryview, exc: Exception) -> str:
    """What was wrong and where, rebuilt so that no value of the message can appear."""
    tag = _known_tag(data)
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        at = _AT.search(text)
        path = "" if at is None else at[2].lstrip(".").replace("[...]", "[*]")
        reason = _reason(text[: at.start()] if at else text, exc)
        if at is not None and at[1]:
            reason += " (a map key)"
    elif isinstance(exc, msgspec.DecodeError):
        path, reason = "", f"malformed message ({type(exc).__name__})"
    else:  # an invariant of __post_init__ that is not a ValueError or TypeError
        path, reason = "", f"rejected ({type(exc).__name__})"
    if path == TAG_FIELD:
        return "unknown message tag" if tag is None else f"message {tag}: malformed tag"
    if tag is None:
        return reason if reason.startswith("malformed") else f"malformed message: {reason}"
    where = f"message {tag}: field {path}" if path else f"message {tag}"
    return f"{where}: {reason}"


def _reason(text: str, exc: Exception) -> str:
    cause = exc.__cause__
    if cause is not None:  # raised by a __post_init__: its message may quote values
        return f"rejected ({type(cause).__name__})"
    for pattern, say in _REASONS:
        m = pattern.fullmatch(text)
        if m is not None:
            return say(m)
    return "invalid value"


# ----------------------------------------------------------------------------- public codec
def encode(msg: object) -> bytes:
    """Encode a registered message to msgpack bytes. Wrong field types raise BadInput."""
    cls = type(msg)
    tag = _TAG_BY_CLASS.get(cls)
    if tag is None:
        raise BadInput(f"{cls.__qualname__} is not a registered message")
    decoder = _decoder()  # outside the try: a broken registration is not the message's fault
    try:
        data = _ENCODER.encode(msg)
    except (OverflowError, ValueError, TypeError) as e:  # e.g. an int beyond 64 bits, a set
        raise BadInput(f"message {tag}: cannot pack ({type(e).__name__})") from None
    try:
        back = decoder.decode(data)
    except Exception as e:  # the receiver would refuse it: say so here, in the same words
        raise BadInput(_explain(data, e)) from None
    # A list for a tuple, or a dict for a nested message, packs but comes back as something
    # else: refuse it (the bytes would not be canonical).
    if back != msg:
        raise BadInput(f"message {tag}: a field does not hold its declared type")
    return data


@overload
def decode(data: bytes | bytearray | memoryview, *, expect: tuple[type[_M], type[_N]]) -> _M | _N: ...
@overload
def decode(data: bytes | bytearray | memoryview, *, expect: tuple[type[_M], type[_N], type[_O]]) -> _M | _N | _O: ...
@overload
def decode(data: bytes | bytearray | memoryview, *, expect: type[_M] | tuple[type[_M], ...]) -> _M: ...
@overload
def decode(data: bytes | bytearray | memoryview, *, expect: None = None) -> object: ...


def decode(data: bytes | bytearray | memoryview, *,
           expect: type | tuple[type, ...] | None = None) -> object:
    """Decode and strictly validate one message; anything wrong raises ProtocolError, and so
    does a message not of ``expect`` (a class or tuple of classes) when given."""
    n = len(data)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_FRAME_BYTES}")
    decoder = _decoder()  # outside the try: a broken registration is not the peer's fault
    try:
        # msgspec checks every declared length against the bytes left before allocating, so
        # a lying length prefix inside a small frame costs nothing.
        msg = decoder.decode(data)
    except Exception as e:  # any malformed input, whatever msgspec or an invariant raised
        raise ProtocolError(_explain(data, e)) from None
    if _may_hold_float(type(msg)) and _holds_nan(msg):
        raise ProtocolError(f"message {_TAG_BY_CLASS[type(msg)]}: a number field holds NaN")
    if expect is not None and type(msg) not in (expect if isinstance(expect, tuple) else (expect,)):
        raise ProtocolError(f"unexpected message {_TAG_BY_CLASS[type(msg)]}; expected {_names(expect)}")
    return msg


_FLOATY: dict[type, bool] = {}  # message class -> whether any field, however nested, may be a float


def _may_hold_float(cls: type) -> bool:
    """Whether a `cls` can hold a float, from its schema, once per class: the hot path's
    messages (a push per copy record) hold none and skip the walk for NaN."""
    known = _FLOATY.get(cls)
    if known is None:
        known = _FLOATY[cls] = _floaty(msgspec.inspect.type_info(cls), set())
    return known


def _floaty(t: msgspec.inspect.Type, seen: set[type]) -> bool:
    if isinstance(t, (msgspec.inspect.FloatType, msgspec.inspect.AnyType, msgspec.inspect.CustomType)):
        return True  # a float, or a type the schema does not spell out
    if isinstance(t, msgspec.inspect.StructType):
        if t.cls in seen:  # a recursive message: its fields are being looked at already
            return False
        seen.add(t.cls)
        return any(_floaty(f.type, seen) for f in t.fields)
    inner = (*getattr(t, "types", ()), *getattr(t, "item_types", ()),
             *(getattr(t, a) for a in ("item_type", "key_type", "value_type") if hasattr(t, a)))
    return any(_floaty(i, seen) for i in inner)


def _holds_nan(value: object) -> bool:
    """Whether a decoded message holds a NaN anywhere: a NaN deadline compares false with
    everything, and the message could not be sent on (it never equals itself)."""
    if isinstance(value, float):
        return value != value
    if isinstance(value, msgspec.Struct):
        return any(_holds_nan(getattr(value, f)) for f in value.__struct_fields__)
    if isinstance(value, (tuple, list)):
        return any(_holds_nan(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_nan(v) for v in value.values())
    return False


def _names(expect: type | tuple[type, ...]) -> str:
    classes = expect if isinstance(expect, tuple) else (expect,)
    return ", ".join(_TAG_BY_CLASS.get(c, getattr(c, "__qualname__", "?")) for c in classes)
