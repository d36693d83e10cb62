"""gputravel.protocol.codec: round trips, strict rejections that never leak values, fuzzing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputravel.protocol import codec as wire
from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol.codec import decode, encode, message

SECRET = b"\x13SECRET-KEY-MATERIAL-7f3a9c\x37"
SECRET_TEXT = "SECRET-PLAINTEXT-c0ffee"


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Mode(enum.StrEnum):
    PUSH = "push"
    PULL = "pull"


@message("test.wire.inner")
@dataclass(frozen=True)
class Inner:
    blob: bytes
    n: int


@message("test.wire.all")
@dataclass(frozen=True)
class All:
    i: int
    f: float
    s: str
    b: bytes
    flag: bool
    nothing: None
    maybe: int | None
    opt_inner: Inner | None
    ints: tuple[int, ...]
    pair: tuple[str, bytes]
    table: dict[str, Inner]
    color: Color
    mode: Mode
    inner: Inner
    inners: tuple[Inner, ...]


@message("test.wire.node")
@dataclass(frozen=True)
class Node:  # self-referential: hints resolve only after the class name exists
    label: str
    child: Node | None


@message("test.wire.ping")
@dataclass(frozen=True)
class Ping:
    seq: int


@message("test.wire.checked")
@dataclass(frozen=True)
class Checked:
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != 4:
            raise ValueError(f"bad secret {self.secret!r}")  # quotes the value on purpose


def sample() -> All:
    return All(
        i=-(2**40), f=1.5, s="héllo", b=b"\x00\xff" * 8, flag=True, nothing=None, maybe=7,
        opt_inner=Inner(b"x", 1), ints=(1, 2, 3), pair=("k", b"v"),
        table={"a": Inner(b"a", 1), "b": Inner(b"", 0)}, color=Color.GREEN, mode=Mode.PULL,
        inner=Inner(b"in", 5), inners=(Inner(b"1", 1), Inner(b"2", 2)),
    )


def raw_fields(msg: object) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)["f"]


def pack(tag: str, fields: object) -> bytes:
    return msgpack.packb({"t": tag, "f": fields}, use_bin_type=True)


def assert_rejected(data: bytes, *needles: str, expect=None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data, expect=expect)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    assert SECRET.decode("latin-1") not in text and SECRET_TEXT not in text
    assert "SECRET" not in text, text
    return info.value


# ----------------------------------------------------------------------------- round trips
def test_round_trip_every_type() -> None:
    msg = sample()
    out = decode(encode(msg))
    assert out == msg
    assert type(out.color) is Color and type(out.mode) is Mode
    assert type(out.b) is bytes and type(out.ints) is tuple


def test_round_trip_optionals_absent_and_empty_containers() -> None:
    msg = replace(sample(), maybe=None, opt_inner=None, ints=(), table={}, inners=())
    assert decode(encode(msg)) == msg


def test_self_reference_and_expect() -> None:
    tree = Node("root", Node("leaf", None))
    assert decode(encode(tree), expect=Node) == tree
    assert decode(encode(tree), expect=(Ping, Node)) == tree


def test_bytes_like_encode_as_bytes() -> None:
    out = decode(encode(Inner(bytearray(b"ab"), 1)))  # type: ignore[arg-type]
    assert out == Inner(b"ab", 1) and type(out.blob) is bytes


def test_int_is_accepted_for_float() -> None:
    fields = raw_fields(sample())
    fields["f"] = 3
    out = decode(pack("test.wire.all", fields))
    assert out.f == 3.0 and type(out.f) is float


def test_bytes_are_msgpack_bin() -> None:
    assert msgpack.unpackb(encode(Inner(b"\x01", 1)), raw=True)[b"f"][b"blob"] == b"\x01"


def test_16k_message_is_fast() -> None:
    msg = Inner(bytes(16 * 1024), 3)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        decode(encode(msg))
    per_call = (time.perf_counter() - start) / n
    assert per_call < 200e-6, f"{per_call * 1e6:.1f} us per round trip"


# ----------------------------------------------------------------------------- rejections
def mutate(**changes: object) -> bytes:
    fields = raw_fields(sample())
    fields.update(changes)
    return pack("test.wire.all", fields)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"i": SECRET}, "field i"),
        ({"i": True}, "field i"),  # bool is not int
        ({"f": SECRET_TEXT}, "field f"),
        ({"s": SECRET}, "field s"),
        ({"b": SECRET_TEXT}, "field b"),
        ({"flag": 1}, "field flag"),
        ({"nothing": SECRET}, "field nothing"),
        ({"maybe": SECRET}, "field maybe"),
        ({"ints": [1, SECRET]}, "field ints[1]"),
        ({"ints": SECRET}, "field ints"),
        ({"pair": ["k", SECRET, SECRET]}, "field pair"),
        ({"pair": [SECRET, b"v"]}, "field pair[0]"),
        ({"table": {"a": {"blob": SECRET, "n": SECRET_TEXT}}}, "field table[*].n"),
        ({"table": {SECRET: {"blob": b"", "n": 1}}}, "field table"),
        ({"color": 99}, "field color"),
        ({"color": SECRET_TEXT}, "field color"),
        ({"mode": SECRET_TEXT}, "field mode"),
        ({"inner": {"blob": SECRET, "n": SECRET}}, "field inner.n"),
        ({"inner": {"blob": SECRET}}, "field inner: missing field n"),
        ({"inner": SECRET}, "field inner"),
        ({"inners": [{"blob": b"", "n": 1}, {"blob": SECRET_TEXT, "n": 2}]}, "field inners[1].blob"),
        ({"opt_inner": {"blob": SECRET, "n": 1, "x": SECRET}}, "field opt_inner"),
        ({"extra_field": SECRET}, "extra_field"),
    ],
)
def test_rejections_name_tag_and_field_not_value(changes: dict, field: str) -> None:
    assert_rejected(mutate(**changes), "test.wire.all", field)


def test_missing_field() -> None:
    fields = raw_fields(sample())
    del fields["mode"]
    assert_rejected(pack("test.wire.all", fields), "test.wire.all", "missing field mode")


def test_unknown_tag_malformed_and_shapes() -> None:
    assert_rejected(pack("test.wire.nope", {}), "unknown message tag", "test.wire.nope")
    assert_rejected(b"\xc1" + SECRET, "malformed")
    assert_rejected(encode(Ping(1))[:-1], "malformed")
    assert_rejected(encode(Ping(1)) + b"\x00", "malformed")
    assert_rejected(msgpack.packb([1, 2]), "malformed")
    assert_rejected(msgpack.packb({"t": "test.wire.ping", "f": {"seq": 1}, "x": 1}), "malformed")
    assert_rejected(pack("test.wire.ping", [SECRET]), "test.wire.ping", "field map")
    assert_rejected(b"", "malformed")


def test_expect_rejects_other_classes() -> None:
    assert_rejected(encode(Ping(1)), "test.wire.ping", "test.wire.node", expect=Node)
    assert_rejected(encode(Ping(1)), "test.wire.inner", expect=(Node, Inner))


def test_post_init_failure_is_protocol_error_without_value() -> None:
    assert_rejected(pack("test.wire.checked", {"secret": SECRET}), "test.wire.checked",
                    "ValueError")


def test_huge_length_prefix_inside_small_message_is_rejected_cheaply() -> None:
    # bin32 claiming 2 GiB: must fail on the size bound, not try to allocate it.
    assert_rejected(b"\xc6\x7f\xff\xff\xff" + SECRET, "malformed")
    assert_rejected(b"\xdd\x7f\xff\xff\xff", "malformed")  # array32 of 2**31 items
    assert_rejected(b"\x91" * 5000, "malformed")  # nesting deeper than msgpack's stack


def test_encode_rejects_wrong_types_without_value() -> None:
    with pytest.raises(BadInput) as info:
        encode(replace(sample(), i=SECRET_TEXT))
    assert "test.wire.all" in str(info.value) and "field i" in str(info.value)
    assert SECRET_TEXT not in str(info.value)
    with pytest.raises(BadInput, match=r"inners\[1\]\.n"):
        encode(replace(sample(), inners=(Inner(b"", 1), Inner(b"", True))))  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="field color"):
        encode(replace(sample(), color=1))  # plain int is not a Color
    with pytest.raises(BadInput, match="cannot pack"):
        encode(Ping(2**70))
    with pytest.raises(BadInput, match="not a registered message"):
        encode(object())


# ----------------------------------------------------------------------------- registration
def test_registration_rules() -> None:
    with pytest.raises(BadInput, match="already registered"):
        @message("test.wire.ping")
        @dataclass(frozen=True)
        class Dup:
            x: int

    with pytest.raises(TypeError, match="frozen"):
        @message("test.wire.mutable")
        @dataclass
        class Mutable:
            x: int

    with pytest.raises(TypeError, match="unsupported"):
        @message("test.wire.badtype")
        @dataclass(frozen=True)
        class BadType:
            x: list[int]

    with pytest.raises(TypeError, match="unsupported|only"):
        @message("test.wire.union")
        @dataclass(frozen=True)
        class Union2:
            x: int | str

    # A failed registration releases its tag.
    with pytest.raises(TypeError):
        @message("test.wire.released")
        @dataclass(frozen=True)
        class First:
            x: set[int]

    @message("test.wire.released")
    @dataclass(frozen=True)
    class Second:
        x: int

    assert wire.tag_of(Second) == "test.wire.released" and wire.registered("test.wire.released") is Second


# ----------------------------------------------------------------------------- fuzzing
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    decode_or_protocol_error(data)


VALID = [encode(sample()), encode(Node("a", Node("b", None))), encode(Ping(5)),
         encode(replace(sample(), opt_inner=None, maybe=None))]


@FUZZ
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255),
                                                  st.sampled_from(["set", "insert", "delete"])),
                                        min_size=1, max_size=6), st.integers(0, 10**6))
def test_fuzz_mutated_valid_encodings_only_raise_protocol_error(
        base: bytes, edits: list[tuple[int, int, str]], cut: int) -> None:
    data = bytearray(base)
    for pos, byte, op in edits:
        pos %= len(data) + 1
        if op == "insert":
            data.insert(pos, byte)
        elif data and pos < len(data):
            if op == "set":
                data[pos] = byte
            else:
                del data[pos]
    decode_or_protocol_error(bytes(data))
    decode_or_protocol_error(bytes(data[: cut % (len(data) + 1)]))
