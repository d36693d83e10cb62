"""Typed protocol messages carried as msgpack.

Every message is a frozen dataclass registered under a unique tag with ``@message("tag")``.

Encoding (documented, stable): a msgpack map ``{"t": tag, "f": {field_name: value}}``.
Nested registered dataclasses are encoded as their field map only (``{field_name: value}``),
because the receiving side knows their class from the type hint. ``bytes`` travel as msgpack
``bin`` (``use_bin_type=True``), enums travel as their value, tuples as arrays.

Decoding is strict: unknown tag, missing or extra field, wrong type, bad tuple length or an
enum value outside the enum all raise :class:`ProtocolError`. Error messages name the tag and
the field path but never the offending value, because values may be secret (keys, blobs).

Each class's type hints are turned into a per-field plan of small converter closures the first
time the class is used (or at registration when its hints already resolve), so the hot path
does no ``typing`` introspection: it is one ``packb``/``unpackb`` plus one call per field.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from gputravel.errors import BadInput, ProtocolError

__all__ = ["MAX_FRAME_BYTES", "message", "encode", "decode", "tag_of", "registered"]

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest encoded message (and transport frame payload) accepted anywhere."""

_CLASS_BY_TAG: dict[str, type] = {}
_TAG_BY_CLASS: dict[type, str] = {}
_PLANS: dict[type, _Plan] = {}


class _Reject(Exception):
    """Internal: a value does not fit its type. Carries a path, never the value."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path: list[str] = []


class _Conv(NamedTuple):
    """How one type hint is turned into msgpack-native data and back."""

    enc: Callable[[Any], Any]
    dec: Callable[[Any], Any]


class _Plan(NamedTuple):
    """Compiled per-class field plan: (name, converter) in declaration order."""

    cls: type
    tag: str
    fields: tuple[tuple[str, _Conv], ...]
    names: frozenset[str]


# ----------------------------------------------------------------------------- registration
def message(tag: str) -> Callable[[type], type]:
    """Class decorator: register a frozen dataclass as a wire message under ``tag``."""
    if not isinstance(tag, str) or not tag:
        raise BadInput("message tag must be a non-empty string")

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@message({tag!r}) needs a dataclass, got {cls!r}")
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"@message({tag!r}): {cls.__qualname__} must be frozen")
        if tag in _CLASS_BY_TAG:
            raise BadInput(f"message tag {tag!r} already registered by "
                           f"{_CLASS_BY_TAG[tag].__qualname__}")
        if cls in _TAG_BY_CLASS:
            raise BadInput(f"{cls.__qualname__} already registered as {_TAG_BY_CLASS[cls]!r}")
        _CLASS_BY_TAG[tag] = cls
        _TAG_BY_CLASS[cls] = tag
        try:
            _plan(cls)  # fail at import time on unsupported field types
        except NameError:
            pass  # forward reference to a class defined later: compile on first use
        except TypeError:
            del _CLASS_BY_TAG[tag], _TAG_BY_CLASS[cls]
            raise
        return cls

    return register


def tag_of(cls: type) -> str:
    """The tag a message class is registered under."""
    try:
        return _TAG_BY_CLASS[cls]
    except KeyError:
        raise BadInput(f"{getattr(cls, '__qualname__', cls)!r} is not a registered message") from None


def registered(tag: str) -> type:
    """The message class registered under ``tag``."""
    try:
        return _CLASS_BY_TAG[tag]
    except KeyError:
        raise BadInput(f"no message registered under tag {tag!r}") from None


# ----------------------------------------------------------------------------- plan compiler
def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _compile_class(cls)
    return plan


def _compile_class(cls: type) -> _Plan:
    hints = typing.get_type_hints(cls)
    convs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            raise TypeError(f"{cls.__qualname__}.{f.name}: init=False fields cannot travel")
        try:
            convs.append((f.name, _compile(hints[f.name])))
        except TypeError as e:
            raise TypeError(f"{cls.__qualname__}.{f.name}: {e}") from None
    for name, hint in hints.items():
        if isinstance(hint, dataclasses.InitVar):
            raise TypeError(f"{cls.__qualname__}.{name}: InitVar fields cannot travel")
    fields = tuple(convs)
    return _Plan(cls, _TAG_BY_CLASS[cls], fields, frozenset(n for n, _ in fields))


def _compile(hint: Any) -> _Conv:
    """Turn one resolved type hint into a converter pair, or raise TypeError."""
    if hint is type(None) or hint is None:
        return _Conv(_none, _none)
    scalar = _SCALARS.get(hint)
    if scalar is not None:
        return scalar
    if isinstance(hint, type):
        if issubclass(hint, enum.IntEnum):
            return _enum_conv(hint, int)
        if issubclass(hint, enum.StrEnum):
            return _enum_conv(hint, str)
        if dataclasses.is_dataclass(hint):
            if hint not in _TAG_BY_CLASS:
                raise TypeError(f"nested dataclass {hint.__qualname__} must be @message-registered")
            return _dataclass_conv(hint)
        raise TypeError(f"unsupported field type {hint.__qualname__}")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        if len(others) != 1 or len(args) != 2:
            raise TypeError(f"only X | None unions are supported, got {hint!r}")
        return _optional_conv(_compile(others[0]))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _var_tuple_conv(_compile(args[0]))
        if args == ((),):  # tuple[()] spelled the old way
            args = ()
        return _fixed_tuple_conv(tuple(_compile(a) for a in args))
    if origin is dict:
        if not args or args[0] is not str:
            raise TypeError(f"only dict[str, X] is supported, got {hint!r}")
        return _dict_conv(_compile(args[1]))
    raise TypeError(f"unsupported field type {hint!r}")


# ----------------------------------------------------------------------------- scalar converters
def _none(v: Any) -> None:
    if v is not None:
        raise _Reject(f"expected None, got {type(v).__name__}")
    return None


def _exact(t: type) -> Callable[[Any], Any]:
    # Decoded msgpack values are exactly these builtin types; subclasses never appear.
    name = t.__name__

    def check(v: Any) -> Any:
        if type(v) is not t:
            raise _Reject(f"expected {name}, got {type(v).__name__}")
        return v

    return check


def _enc_int(v: Any) -> int:
    # bool is an int subclass but a different protocol type: refuse it.
    if type(v) is int:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return int(v)
    raise _Reject(f"expected int, got {type(v).__name__}")


def _float(v: Any) -> float:
    # An int is an acceptable float (msgpack peers may pack 1.0 as 1); bool is not.
    t = type(v)
    if t is float:
        return v
    if t is int or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return float(v)
    raise _Reject(f"expected float, got {t.__name__}")


def _enc_str(v: Any) -> str:
    if type(v) is str:
        return v
    if isinstance(v, str):
        return str(v)  # plain str for StrEnum members or other subclasses
    raise _Reject(f"expected str, got {type(v).__name__}")


def _enc_bytes(v: Any) -> Any:
    # Accept bytes-like on the way out to avoid a copy; it always decodes as bytes.
    if isinstance(v, (bytes, bytearray, memoryview)):
        return v
    raise _Reject(f"expected bytes, got {type(v).__name__}")


_SCALARS: dict[Any, _Conv] = {
    int: _Conv(_enc_int, _exact(int)),
    float: _Conv(_float, _float),
    str: _Conv(_enc_str, _exact(str)),
    bytes: _Conv(_enc_bytes, _exact(bytes)),
    bool: _Conv(_exact(bool), _exact(bool)),
}


# ----------------------------------------------------------------------------- composite converters
def _enum_conv(cls: type[enum.Enum], base: type) -> _Conv:
    name = cls.__qualname__

    def enc(v: Any) -> Any:
        if not isinstance(v, cls):
            raise _Reject(f"expected {name}, got {type(v).__name__}")
        return base(v.value)

    def dec(v: Any) -> Any:
        if type(v) is not base:
            raise _Reject(f"expected {name} ({base.__name__}), got {type(v).__name__}")
        try:
            return cls(v)
        except ValueError:
            raise _Reject(f"value is not a member of {name}") from None

    return _Conv(enc, dec)


def _optional_conv(inner: _Conv) -> _Conv:
    ienc, idec = inner

    def enc(v: Any) -> Any:
        return None if v is None else ienc(v)

    def dec(v: Any) -> Any:
        return None if v is None else idec(v)

    return _Conv(enc, dec)


def _at(path: str, conv: Callable[[Any], Any], v: Any) -> Any:
    """Run a converter, prefixing the path on rejection (slow path only)."""
    try:
        return conv(v)
    except _Reject as r:
        r.path.insert(0, path)
        raise


def _var_tuple_conv(inner: _Conv) -> _Conv:
    ienc, idec = inner

    def run(conv: Callable[[Any], Any], v: Any) -> tuple[Any, ...]:
        try:
            return tuple([conv(e) for e in v])
        except _Reject as r:
            # Recompute the index only on failure: keeps the happy path a list comprehension.
            for i, e in enumerate(v):
                _at(f"[{i}]", conv, e)
            raise r

    def enc(v: Any) -> Any:
        if not isinstance(v, tuple):
            raise _Reject(f"expected tuple, got {type(v).__name__}")
        return run(ienc, v)

    def dec(v: Any) -> Any:
        if type(v) is not tuple:
            raise _Reject(f"expected array, got {type(v).__name__}")
        return run(idec, v)

    return _Conv(enc, dec)


def _fixed_tuple_conv(items: tuple[_Conv, ...]) -> _Conv:
    n = len(items)
    encs = tuple(c.enc for c in items)
    decs = tuple(c.dec for c in items)

    def run(convs: tuple[Callable[[Any], Any], ...], v: Any) -> tuple[Any, ...]:
        if len(v) != n:
            raise _Reject(f"expected {n} items, got {len(v)}")
        return tuple([_at(f"[{i}]", c, e) for i, (c, e) in enumerate(zip(convs, v))])

    def enc(v: Any) -> Any:
        if not isinstance(v, tuple):
            raise _Reject(f"expected tuple, got {type(v).__name__}")
        return run(encs, v)

    def dec(v: Any) -> Any:
        if type(v) is not tuple:
            raise _Reject(f"expected array, got {type(v).__name__}")
        return run(decs, v)

    return _Conv(enc, dec)


def _dict_conv(inner: _Conv) -> _Conv:
    ienc, idec = inner

    def run(conv: Callable[[Any], Any], v: dict[Any, Any]) -> dict[str, Any]:
        out = {}
        for k, e in v.items():
            if type(k) is not str:
                # Keys can be data too: name the key's type, not the key.
                raise _Reject(f"expected str key, got {type(k).__name__}")
            out[k] = _at("[*]", conv, e)
        return out

    def enc(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _Reject(f"expected dict, got {type(v).__name__}")
        return run(ienc, v)

    def dec(v: Any) -> Any:
        if type(v) is not dict:
            raise _Reject(f"expected map, got {type(v).__name__}")
        return run(idec, v)

    return _Conv(enc, dec)


def _dataclass_conv(cls: type) -> _Conv:
    # The nested plan is looked up at call time so forward and self references work.
    def enc(v: Any) -> Any:
        if type(v) is not cls:
            raise _Reject(f"expected {cls.__qualname__}, got {type(v).__name__}")
        return _encode_fields(_plan(cls), v)

    def dec(v: Any) -> Any:
        return _decode_fields(_plan(cls), v)

    return _Conv(enc, dec)


# ----------------------------------------------------------------------------- field maps
def _encode_fields(plan: _Plan, msg: Any) -> dict[str, Any]:
    out = {}
    for name, conv in plan.fields:
        out[name] = _at(name, conv.enc, getattr(msg, name))
    return out


def _decode_fields(plan: _Plan, raw: Any) -> Any:
    if type(raw) is not dict:
        raise _Reject(f"expected field map, got {type(raw).__name__}")
    if len(raw) != len(plan.fields) or raw.keys() != plan.names:
        missing = sorted(plan.names - raw.keys())
        if missing:
            raise _Reject(f"missing field {missing[0]}")
        extra = sorted(str(k)[:64] for k in raw.keys() - plan.names)
        raise _Reject(f"unexpected extra field {extra[0]!r}")
    kwargs = {}
    for name, conv in plan.fields:
        kwargs[name] = _at(name, conv.dec, raw[name])
    try:
        return plan.cls(**kwargs)
    except Exception as e:  # __post_init__ invariants; its message may quote values
        raise _Reject(f"rejected by {plan.cls.__qualname__} ({type(e).__name__})") from None


def _where(tag: str, r: _Reject) -> str:
    if r.path:
        return f"message {tag}: field {'.'.join(r.path).replace('.[', '[')}: {r.reason}"
    return f"message {tag}: {r.reason}"


# ----------------------------------------------------------------------------- public codec
def encode(msg: object) -> bytes:
    """Encode a registered message to msgpack bytes. Wrong field types raise BadInput."""
    cls = type(msg)
    tag = _TAG_BY_CLASS.get(cls)
    if tag is None:
        raise BadInput(f"{cls.__qualname__} is not a registered message")
    plan = _plan(cls)
    try:
        fields = _encode_fields(plan, msg)
    except _Reject as r:
        raise BadInput(_where(tag, r)) from None
    try:
        return msgpack.packb({"t": tag, "f": fields}, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as e:  # e.g. int beyond 64 bits
        raise BadInput(f"message {tag}: cannot pack ({type(e).__name__})") from None


def decode(data: bytes | bytearray | memoryview, *,
           expect: type | tuple[type, ...] | None = None) -> object:
    """Decode and strictly validate one message; anything wrong raises ProtocolError."""
    n = len(data)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        # Every length limit is bounded by the input size, so a lying length prefix inside a
        # small frame cannot make msgpack allocate more than the frame itself; msgpack also
        # bounds nesting depth (StackError). Arrays decode as tuples to match tuple fields.
        top = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True,
                              max_str_len=n, max_bin_len=n, max_array_len=n,
                              max_map_len=n, max_ext_len=n)
    except Exception as e:  # any malformed input, whatever msgpack chose to raise
        raise ProtocolError(f"malformed message ({type(e).__name__})") from None
    if type(top) is not dict or len(top) != 2 or type(top.get("t")) is not str or "f" not in top:
        raise ProtocolError("malformed message: expected {t: tag, f: fields}")
    tag = top["t"]
    cls = _CLASS_BY_TAG.get(tag)
    if cls is None:
        # Tags are protocol vocabulary, not secrets: echo (a bounded prefix) to debug mismatches.
        raise ProtocolError(f"unknown message tag {tag[:64]!r}")
    if expect is not None and not _expected(cls, expect):
        raise ProtocolError(f"unexpected message {tag}; expected {_names(expect)}")
    try:
        return _decode_fields(_plan(cls), top["f"])
    except _Reject as r:
        raise ProtocolError(_where(tag, r)) from None


def _expected(cls: type, expect: type | tuple[type, ...]) -> bool:
    if isinstance(expect, tuple):
        return cls in expect
    return cls is expect


def _names(expect: type | tuple[type, ...]) -> str:
    classes = expect if isinstance(expect, tuple) else (expect,)
    return ", ".join(_TAG_BY_CLASS.get(c, getattr(c, "__qualname__", "?")) for c in classes)
