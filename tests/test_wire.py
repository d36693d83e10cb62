"""gputravel.protocol.codec: round trips, the documented encoding, strict rejections that never
leak values, secrets kept out of repr, fuzzing."""

from __future__ import annotations

import enum
import time
import tracemalloc

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples  # tests/profiles.py: counts for the thorough profile
from msgspec.structs import replace
from rich.pretty import pretty_repr

from gputravel.crypto.channel import IV_BYTES, KEY_BYTES, ChannelState
from gputravel.errors import BadInput, ProtocolError
from gputravel.protocol import codec as wire
from gputravel.protocol.codec import Message, decode, encode
from gputravel.protocol.travel import ChunkInfo, TravelRefused, TravelRequest, TravelResult

SECRET = b"\x13SECRET-KEY-MATERIAL-7f3a9c\x37"
SECRET_TEXT = "SECRET-PLAINTEXT-c0ffee"


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


class Mode(enum.StrEnum):
    PUSH = "push"
    PULL = "pull"


class Inner(Message, tag="test.wire.inner"):
    blob: bytes
    n: int


class All(Message, tag="test.wire.all"):
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


class Node(Message, tag="test.wire.node"):  # self-referential: hints resolve only after the class name exists
    label: str
    child: Node | None


class Ping(Message, tag="test.wire.ping"):
    seq: int


class Checked(Message, tag="test.wire.checked"):
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


class Sealed(Message, tag="test.wire.sealed", secret=("key", "blob")):
    name: str
    key: bytes
    n: int
    blob: bytes


class Loose(msgspec.Struct, frozen=True):  # a struct, but no message: cannot be nested in one
    x: int


def raw_fields(msg: object) -> dict:
    """The encoded map of ``msg``, its tag included."""
    return msgpack.unpackb(encode(msg), raw=False)


def pack(tag: str, fields: dict) -> bytes:
    return msgpack.packb({"t": tag, **fields}, use_bin_type=True)


def inner(**fields: object) -> dict:
    """A nested Inner as it travels: a map with its own tag."""
    return {"t": "test.wire.inner", **fields}


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
    assert msgpack.unpackb(encode(Inner(b"\x01", 1)), raw=True)[b"blob"] == b"\x01"


def test_the_documented_encoding() -> None:
    # {"t": tag, field: value, ...}: the tag first, then every field in declaration order;
    # nested messages as maps of the same form; enums as values; tuples as arrays.
    raw = msgpack.unpackb(encode(sample()), raw=False, use_list=False)
    assert list(raw) == ["t", *All.__struct_fields__] and raw["t"] == "test.wire.all"
    assert raw["inner"] == {"t": "test.wire.inner", "blob": b"in", "n": 5}
    assert raw["table"]["b"] == {"t": "test.wire.inner", "blob": b"", "n": 0}
    assert (raw["color"], raw["mode"], raw["ints"], raw["pair"]) == (2, "pull", (1, 2, 3), ("k", b"v"))
    assert raw["nothing"] is None and raw["opt_inner"] == {"t": "test.wire.inner", "blob": b"x", "n": 1}
    assert encode(Ping(5)) == msgpack.packb({"t": "test.wire.ping", "seq": 5})


def test_a_nested_message_may_leave_its_tag_out() -> None:
    # Its field declares the class; another message's tag there is refused (see rejections).
    raw = raw_fields(sample())
    del raw["inner"]["t"], raw["inners"][1]["t"]
    assert decode(msgpack.packb(raw, use_bin_type=True)) == sample()


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
        ({"table": {"a": inner(blob=SECRET, n=SECRET_TEXT)}}, "field table[*].n"),
        ({"table": {SECRET: inner(blob=b"", n=1)}}, "field table"),
        ({"color": 99}, "field color"),
        ({"color": SECRET_TEXT}, "field color"),
        ({"mode": SECRET_TEXT}, "field mode"),
        ({"inner": inner(blob=SECRET, n=SECRET)}, "field inner.n"),
        ({"inner": inner(blob=SECRET)}, "field inner: missing field n"),
        ({"inner": SECRET}, "field inner"),
        ({"inner": {"t": "test.wire.ping", "seq": 1}}, "field inner"),  # another message's tag
        ({"inner": {"t": SECRET_TEXT, "blob": b"", "n": 1}}, "field inner"),
        ({"inners": [inner(blob=b"", n=1), inner(blob=SECRET_TEXT, n=2)]}, "field inners[1].blob"),
        ({"opt_inner": inner(blob=SECRET, n=1, x=SECRET)}, "field opt_inner"),
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
    # A tag is a value too: an unknown one is never echoed (a peer could put anything there).
    assert_rejected(pack("test.wire.nope", {}), "unknown message tag")
    assert_rejected(pack(SECRET_TEXT, {"seq": 1}), "unknown message tag")
    assert_rejected(msgpack.packb({"t": SECRET, "seq": 1}, use_bin_type=True), "unknown message tag")
    assert_rejected(msgpack.packb({"seq": 1}), "malformed", "missing field t")
    assert_rejected(b"\xc1" + SECRET, "malformed")
    assert_rejected(encode(Ping(1))[:-1], "malformed")
    assert_rejected(encode(Ping(1)) + b"\x00", "malformed")
    assert_rejected(msgpack.packb([1, 2]), "malformed")
    assert_rejected(msgpack.packb(["test.wire.ping", SECRET], use_bin_type=True), "malformed")
    # The old envelope {"t": tag, "f": fields} is refused too: "f" is no field of Ping.
    assert_rejected(msgpack.packb({"t": "test.wire.ping", "f": {"seq": 1}}), "test.wire.ping", "extra field 'f'")
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
    # The same lies inside a field of a known message, and a deep nest before the tag.
    head = msgpack.packb({"t": "test.wire.all"})[:-1]
    tracemalloc.start()
    try:
        for lie in (b"\xc6\x7f\xff\xff\xff", b"\xdd\x7f\xff\xff\xff", b"\xdf\x7f\xff\xff\xff"):
            assert_rejected(b"\x82" + head[1:] + b"\xa1b" + lie + SECRET, "malformed")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert_rejected(b"\x82\xa1x" + b"\x91" * 5000 + b"\xa1t\xaetest.wire.ping", "malformed")


def test_encode_rejects_wrong_types_without_value() -> None:
    with pytest.raises(BadInput) as info:
        encode(replace(sample(), i=SECRET_TEXT))
    assert "test.wire.all" in str(info.value) and "field i" in str(info.value)
    assert SECRET_TEXT not in str(info.value)
    with pytest.raises(BadInput, match=r"inners\[1\]\.n"):
        encode(replace(sample(), inners=(Inner(b"", 1), Inner(b"", True))))  # type: ignore[arg-type]
    # On the wire an enum is its value, so what is checked is that the receiver would accept
    # it: a value outside the enum is refused (a plain int naming a member reads as that member).
    with pytest.raises(BadInput, match="field color"):
        encode(replace(sample(), color=99))
    with pytest.raises(BadInput, match="field mode"):
        encode(replace(sample(), mode=SECRET_TEXT))
    with pytest.raises(BadInput, match="field table"):
        encode(replace(sample(), table={1: Inner(b"", 0)}))  # a key that is not a str
    with pytest.raises(BadInput, match="field inner"):
        encode(replace(sample(), inner=Ping(1)))  # another message where an Inner belongs
    with pytest.raises(BadInput, match="cannot pack"):
        encode(Ping(2**70))
    # What packs but would come back as something else: the bytes would not be canonical.
    for wrong in (dict(ints=[1, 2]), dict(ints={1}), dict(inner={"blob": b"", "n": 1}),
                  dict(inners=[Inner(b"", 1)])):
        with pytest.raises(BadInput, match="does not hold its declared type"):
            encode(replace(sample(), **wrong))
    assert decode(encode(replace(sample(), b=bytearray(b"x")))) == replace(sample(), b=b"x")  # same bytes
    with pytest.raises(BadInput, match="not a registered message"):
        encode(object())


# ----------------------------------------------------------------------------- registration
def test_registration_rules() -> None:
    with pytest.raises(BadInput, match="already registered"):
        class Dup(Message, tag="test.wire.ping"):
            x: int

    with pytest.raises(TypeError, match="frozen"):
        class Mutable(Message, tag="test.wire.mutable", frozen=False):
            x: int

    with pytest.raises(TypeError, match="unsupported"):
        class BadType(Message, tag="test.wire.badtype"):
            x: list[int]

    with pytest.raises(TypeError, match=r"unsupported|only"):
        class Union2(Message, tag="test.wire.union"):
            x: int | str

    with pytest.raises(TypeError, match="tag"):
        class Untagged(Message):  # would be tagged with its class name: never implicitly
            x: int

    with pytest.raises(TypeError, match="defaults"):
        class Defaulted(Message, tag="test.wire.defaulted"):
            x: int = 0  # a peer leaving it out would not be an error

    with pytest.raises(TypeError, match="forbid"):
        class Lenient(Message, tag="test.wire.lenient", forbid_unknown_fields=False):
            x: int

    with pytest.raises(TypeError, match="secret"):
        class Typo(Message, tag="test.wire.typo", secret=("kee",)):
            key: bytes

    with pytest.raises(TypeError, match="registered message"):
        class Nests(Message, tag="test.wire.nests"):
            loose: Loose

    # A struct that cannot subclass Message (crypto/) must be configured as Message is.
    with pytest.raises(TypeError, match="frozen"):
        wire.register(msgspec.defstruct("Thawed", [("x", int)], tag_field="t", tag="test.wire.thawed",
                                        forbid_unknown_fields=True))
    with pytest.raises(TypeError, match="tag"):
        wire.register(msgspec.defstruct("NoTag", [("x", int)], frozen=True, forbid_unknown_fields=True))

    # A failed registration releases its tag.
    with pytest.raises(TypeError):
        class First(Message, tag="test.wire.released"):
            x: set[int]

    class Second(Message, tag="test.wire.released"):
        x: int

    assert wire.tag_of(Second) == "test.wire.released" and wire.registered("test.wire.released") is Second
    assert decode(encode(Second(3)), expect=Second) == Second(3)  # the decoder knows the late one


# ----------------------------------------------------------------------------- secrets
def shown(msg: object) -> list[str]:
    """Every way a message is commonly turned into text: repr, str, inside containers, rich."""
    return [repr(msg), str(msg), f"{msg!r}", repr([msg]), repr({"m": msg}), pretty_repr(msg)]


def test_secret_fields_stay_out_of_repr() -> None:
    msg = Sealed(name="visible", key=SECRET, n=7, blob=SECRET_TEXT.encode())
    for text in shown(msg):
        assert "visible" in text and "7" in text, text
        assert "SECRET" not in text and "key=" not in text and "blob=" not in text, text
    assert decode(encode(msg)) == msg  # hidden from repr, not from the wire


def test_context_blobs_and_channel_keys_stay_out_of_repr() -> None:
    # The project's secret-bearing messages: context blobs travel in these, keys in ChannelState.
    chunk = ChunkInfo(dataset_offset=0, nbytes=1, digest=b"d" * 32)
    messages = [
        TravelRequest(travel_id=1, buffer_offset=0, buffer_bytes=1, dataset_offset=0, context=SECRET),
        TravelResult(travel_id=1, context=SECRET, chunk=chunk, steps_ns={"dh_copy": 1}, nonzero_on_arrival=0),
        TravelRefused(travel_id=1, context=SECRET, reason="no", steps_ns={}),
    ]
    for msg in messages:
        for text in shown(msg):
            assert "travel_id=1" in text and "SECRET" not in text and "context" not in text, text
    state = ChannelState(label="Lwlc_h2d_user", key=b"K" * KEY_BYTES, iv_mask=b"M" * IV_BYTES,
                         channel_counter=1, message_counter=2)
    for text in shown(state):
        assert "Lwlc_h2d_user" in text and "KKKK" not in text and "MMMM" not in text, text


# ----------------------------------------------------------------------------- fuzzing
FUZZ = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
