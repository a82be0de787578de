"""The memory tier's wire format: what peers send round-trips exactly as plain data, anything
malformed, too large or too deeply nested is refused with SnapshotFormatError (and a length a
peer announces out of bounds with SnapshotRefused, before anything is allocated), the driver's catalog leaves out layouts that
claim other ranks' chunks, and no module of the tier can unpickle what a peer sends."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.checkpointing.errors import SnapshotFormatError, SnapshotRefused
from stalwart.checkpointing.memory import wire
from stalwart.checkpointing.memory.catalog import foreign_claims, newest_complete
from stalwart.checkpointing.memory.replication import Replicator, check_announced_length
from stalwart.checkpointing.memory.store import Holding, Inventory, MemoryStore
from stalwart.checkpointing.memory.wire import (
    MAX_DEPTH,
    SnapshotMessage,
    claims,
    decode_claims,
    decode_layout,
    decode_message,
    decode_value,
    encode_claims,
    encode_layout,
    encode_message,
    encode_value,
    nesting_depth,
)
from stalwart.checkpointing.snapshot import build_layout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict:
    return {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16),
                      "scale": torch.tensor(2.0)},
            "optim": {"param_groups.w.betas": (0.9, 0.95), "param_groups.w.lr": 3e-4,
                      "param_groups.w.foreach": None, "param_groups.w.amsgrad": False},
            "train": {"step": 7, "samples_seen": 56}}


def _layout():
    return build_layout(_state())[0]


VALUES = {
    "none": None, "flag": True, "int": -3, "big": 1 << 70, "float": 0.1, "neg0": -0.0,
    "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "text": "ü$",
    "list": [1, [2.5, "x"]], "tuple": (0.9, 0.999), "nested": {"a": {"$": 1}, "b": (1,)},
    "int keys": {0: "a", 1: (2, 3)}, "bytes": b"\x00\xff", "dtype": torch.bfloat16,
    "tensor": torch.arange(6, dtype=torch.float16).view(2, 3), "scalar": torch.tensor(3),
    "np": np.float32(1.5), "np int": np.int64(-4), "np bool": np.bool_(True),
}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return (type(b) is dict and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and (a == b or repr(a) == repr(b))


def test_values_round_trip_exactly_with_their_types() -> None:
    text = json.dumps({k: encode_value(v) for k, v in VALUES.items()}, allow_nan=False)
    back = {k: decode_value(v) for k, v in json.loads(text).items()}
    for key, value in VALUES.items():
        assert _same(value, back[key]), key
    assert math.copysign(1, back["neg0"]) == -1


def test_a_value_of_another_kind_is_refused_when_sent() -> None:
    with pytest.raises(SnapshotFormatError, match="of type object cannot be sent"):
        encode_value({"x": object()})


def test_a_layout_round_trips_and_keeps_its_key() -> None:
    layout = _layout()
    back = decode_layout(json.loads(json.dumps(encode_layout(layout))))
    assert back.key == layout.key and back.nbytes == layout.nbytes
    assert back.items == layout.items
    assert back.slots == layout.slots and back.planner_data == layout.planner_data


def _message(**overrides: object) -> SnapshotMessage:
    fields = dict(generation=2, source=1, step=7, nbytes=_layout().nbytes, crc=123,
                  layout_key=_layout().key, layout=_layout(), values={"train.step": 7,
                                                                       "betas": (0.9, 0.95)})
    fields.update(overrides)
    return SnapshotMessage(**fields)  # type: ignore[arg-type]


def test_a_message_round_trips() -> None:
    msg = _message()
    back = decode_message(encode_message(msg))
    assert back == msg


def _tamper(edit) -> bytes:
    obj = json.loads(encode_message(_message()))
    edit(obj)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(("edit", "why"), [
    (lambda o: o.update(step="7"), "message.step is a str"),
    (lambda o: o.update(step=True), "message.step is a bool"),
    (lambda o: o.pop("crc"), "has no 'crc'"),
    (lambda o: o.update(crc=1 << 40), "is not a CRC32"),
    (lambda o: o.update(version=2), "version 2"),
    (lambda o: o["values"].update(x={"$": "pickle", "v": "gASVAA=="}), "unknown tag 'pickle'"),
    (lambda o: o["values"].update(x={"$": "tensor", "dtype": "float32", "shape": [4],
                                     "v": "AAAA"}), "holds 3 bytes"),
    (lambda o: o["values"].update(x={"$": "tensor", "dtype": "Tensor", "shape": [],
                                     "v": ""}), "not a torch dtype"),
    (lambda o: o["values"].update(x={"$": "bytes", "v": "not base64!"}), "not base64"),
    (lambda o: o["layout"].update(key="0" * 16), "does not match its key"),
    (lambda o: o["layout"]["items"][0]["slot"].__setitem__(0, 1 << 40), "outside"),
    (lambda o: o["layout"]["items"][0].update(chunk_sizes=[99, 99]), "does not fit"),
    (lambda o: o["layout"]["items"][0].update(type="code"), "unknown type 'code'"),
    (lambda o: o["layout"].update(nbytes=-1), "negative"),
    (lambda o: o.update(layout_key="other"), "names layout 'other'"),
    (lambda o: o.update(nbytes=1), "its buffer 1"),
])
def test_a_malformed_message_is_refused_naming_what_is_wrong(edit, why: str) -> None:
    with pytest.raises(SnapshotFormatError, match=re.escape(why)):
        decode_message(_tamper(edit))


@pytest.mark.parametrize("data", [b"\x80\x04\x95", b"{", b'{"step": NaN}', b"[]", b"\xff"])
def test_bytes_that_are_not_a_json_message_are_refused(data: bytes) -> None:
    with pytest.raises(SnapshotFormatError):
        decode_message(data)


def test_a_format_error_is_a_refusal() -> None:
    assert issubclass(SnapshotFormatError, SnapshotRefused)


def test_claims_round_trip_and_name_chunks_and_values() -> None:
    layout = _layout()
    assert decode_claims(encode_claims(layout)) == claims(layout)
    assert ("model.w", (0, 0)) in claims(layout) and ("train.step", None) in claims(layout)
    with pytest.raises(SnapshotFormatError):
        decode_claims(b'[["w", ["0"]]]')


# ---------------------------------------------------------------------------- honest layouts

HALF0 = frozenset({("w", (0,)), ("train.step", None)})
HALF1 = frozenset({("w", (2,)), ("train.step", None)})


def test_foreign_claims_are_those_another_rank_declared_and_the_source_did_not() -> None:
    declared = {0: HALF0, 1: HALF1}
    assert foreign_claims(0, HALF0, declared) == []
    assert foreign_claims(0, HALF0 | {("w", (2,))}, declared) == [("w", (2,))]
    assert foreign_claims(0, HALF0 | {("new", (0,))}, declared) == []  # nobody's: lazy state
    assert foreign_claims(0, HALF0 | {("w", (2,))}, {}) == []  # nothing declared


def test_a_layout_claiming_another_ranks_chunk_does_not_complete_a_step() -> None:
    from tests.unit.test_memory_holdings import SHARD0, SHARD1, _chunk, _layout, _value

    # Rank 0's copy held by w1 claims all of "w", rank 1's chunk included; rank 1 is gone.
    forged = _layout("forged", _chunk("w", 0, 2, 4), _chunk("w", 2, 2, 4), _value("train.step"))
    declared = {0: {0: HALF0, 1: HALF1}}
    honest = Inventory(holdings=(Holding(0, 0, 5, SHARD0.key), Holding(0, 1, 4, SHARD1.key),
                                 Holding(0, 0, 4, SHARD0.key)),
                       layouts={SHARD0.key: SHARD0, SHARD1.key: SHARD1}, nbytes=0,
                       claims=declared)
    lying = Inventory(holdings=(Holding(0, 0, 5, "forged"),), layouts={"forged": forged},
                      nbytes=0, claims=declared)
    choice, why = newest_complete({"w0": honest, "w1": lying})
    assert choice is not None and choice.step == 4  # step 5 would need rank 1's chunk
    assert "w1's copy of rank 0's step 5 claims chunks of other ranks (w[2])" in why
    # Without the declared claims the forged layout would have completed step 5.
    blind = {k: Inventory(holdings=v.holdings, layouts=v.layouts, nbytes=0)
             for k, v in {"w0": honest, "w1": lying}.items()}
    assert newest_complete(blind)[0].step == 5


# ---------------------------------------------------------------------------- no pickles


def test_no_module_of_the_memory_tier_can_unpickle_what_a_peer_sends() -> None:
    banned = re.compile(r"pickle|all_gather_object|broadcast_object_list|"
                        r"scatter_object_list|gather_object|recv_object_list|weights_only=False")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "checkpointing" / "memory").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if banned.search(line)]
    assert found == []


# ---------------------------------------------------------------------------- bounds


def _message_with(values_json: bytes) -> bytes:
    head = json.loads(encode_message(_message(layout=None, values={})))
    text = json.dumps(head, separators=(",", ":")).encode()
    assert text.endswith(b'"values":{}}')
    return text[:-len(b"{}}")] + b'{"v":' + values_json + b"}}"


def _nested_list(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [300, 900, 100_000])
@pytest.mark.parametrize(("name", "nest"), [
    ("lists", _nested_list),
    ("objects", lambda d: b'{"a":' * d + b"1" + b"}" * d),
    ("tuples", lambda d: b'{"$":"tuple","v":[' * d + b"]}" * d),
])
def test_a_deeply_nested_message_is_refused_not_a_recursion_error(name: str, nest, depth: int
                                                                  ) -> None:
    # About 600 levels once escaped decode_value as a RecursionError; 100000 the JSON parser.
    with pytest.raises(SnapshotFormatError, match=f"at most {MAX_DEPTH} are accepted"):
        decode_message(_message_with(nest(depth)))


def test_a_deeply_nested_layout_is_refused() -> None:
    obj = json.loads(encode_message(_message()))
    obj["layout"]["planner_data"]["deep"] = "@"
    text = json.dumps(obj).encode().replace(b'"@"', _nested_list(900))
    with pytest.raises(SnapshotFormatError, match="levels of nesting"):
        decode_message(text)


@pytest.mark.parametrize("depth", [4, 900, 100_000])
def test_claims_nested_deeper_than_their_schema_are_refused(depth: int) -> None:
    with pytest.raises(SnapshotFormatError, match=f"{depth} levels of nesting; at most 3"):
        decode_claims(_nested_list(depth))


def test_a_value_nested_to_the_limit_travels_and_one_level_more_is_refused_when_sent() -> None:
    def nested(levels: int) -> object:
        value: object = 1
        for _ in range(levels):
            value = [value]
        return value

    # The message and its values take 2 levels; a list one each.
    fits = _message(values={"v": nested(MAX_DEPTH - 2)})
    assert decode_message(encode_message(fits)) == fits
    with pytest.raises(SnapshotFormatError, match="cannot be sent to peers.*65 levels"):
        encode_message(_message(values={"v": nested(MAX_DEPTH - 1)}))


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = "[" * 500 + '\\"{"' + "]" * 3
    msg = _message(values={"text": text, "key": {text: ["\\", '"']}})
    assert decode_message(encode_message(msg)) == msg
    assert nesting_depth(json.dumps({"a": text}).encode()) == 1
    assert nesting_depth(b'[{"a": "\\\\"}, ["\\"]]"]]') == 2
    assert nesting_depth(b'["never closes \\"[[[') == 1  # and json refuses it


@pytest.mark.parametrize(("decode", "limit", "what"), [
    (decode_message, "MAX_MESSAGE_BYTES", "the message"),
    (decode_claims, "MAX_CLAIMS_BYTES", "the claims"),
])
def test_an_oversized_message_is_refused_before_it_is_parsed(decode, limit: str, what: str,
                                                            monkeypatch) -> None:
    monkeypatch.setattr(wire, limit, 1000)
    with pytest.raises(SnapshotFormatError, match=f"{what}: 1001 bytes; at most 1000"):
        decode(b" " * 1001)


@pytest.mark.parametrize(("edit", "why"), [
    (lambda o: o["values"].update(x={"$": "numpy", "dtype": "|i1", "v": 1000}),
     "1000 does not fit a numpy int8"),
    (lambda o: o["values"].update(x={"$": "numpy", "dtype": "<u8", "v": -1}),
     "does not fit a numpy uint64"),
    (lambda o: o["values"].update(x={"$": "numpy", "dtype": "<f8", "v": 10 ** 400}),
     "does not fit a numpy float64"),
    (lambda o: o["values"].update(x={"$": "tensor", "dtype": "uint8", "shape": [0, 1 << 64],
                                     "v": ""}), "x.shape is not a list of integers from 0"),
    (lambda o: o["layout"]["items"][0].update(size=[1 << 64, 4]),
     "layout item 0.size is not a list of integers"),
    (lambda o: o["layout"]["items"][0].update(offset=[1 << 64, 0]),
     "layout item 0.offset is not a list of integers"),
])
def test_numbers_too_large_for_their_type_are_refused(edit, why: str) -> None:
    with pytest.raises(SnapshotFormatError, match=re.escape(why)):
        decode_message(_tamper(edit))


def test_an_integer_of_too_many_digits_is_refused() -> None:
    with pytest.raises(SnapshotFormatError, match="not UTF-8 JSON"):
        decode_message(_message_with(b"1" * 5000))
    with pytest.raises(SnapshotFormatError, match="not UTF-8 JSON"):
        decode_claims(b'[["w", [' + b"1" * 5000 + b"]]]")


def test_an_empty_tensor_value_round_trips() -> None:
    msg = _message(values={"empty": torch.empty(0, 3, dtype=torch.bfloat16)})
    back = decode_message(encode_message(msg)).values["empty"]
    assert back.shape == (0, 3) and back.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- announced lengths


def test_an_announced_length_out_of_bounds_is_refused_naming_the_rank() -> None:
    check_announced_length(3, 64, 64, "its claims")
    check_announced_length(3, 0, 64, "its claims")
    with pytest.raises(SnapshotRefused, match=r"rank 3 announces its claims of 4611686018427387904 "
                                              r"bytes; from 0 to 64 are accepted"):
        check_announced_length(3, 1 << 62, 64, "its claims")
    with pytest.raises(SnapshotRefused, match="rank 1 announces .* of -1 bytes"):
        check_announced_length(1, -1, 64, "its claims")
    with pytest.raises(SnapshotRefused, match="of 0 bytes; from 1 to 64"):
        check_announced_length(1, 0, 64, "a snapshot message", minimum=1)


def _replicator(max_bytes: int) -> Replicator:
    return Replicator(rank=0, generation=0, holders={}, store=MemoryStore(), max_bytes=max_bytes)


@pytest.mark.parametrize(("headers", "why"), [
    ({1: [1, 1 << 62, 10]}, "rank 1 announces a snapshot buffer of 4611686018427387904"),
    ({2: [1, -5, 10]}, "rank 2 announces a snapshot buffer of -5"),
    ({1: [1, 10, 1 << 40]}, "rank 1 announces a snapshot message of 1099511627776"),
    ({1: [1, 10, 0]}, "rank 1 announces a snapshot message of 0 bytes"),
    ({1: [1, 60, 10], 2: [1, 60, 10]}, "ranks [1, 2] announce snapshot buffers of 120 bytes"),
])
def test_a_header_out_of_bounds_is_refused_before_anything_is_allocated(headers, why: str
                                                                       ) -> None:
    replicator = _replicator(max_bytes=100)
    try:
        with pytest.raises(SnapshotRefused, match=re.escape(why)):
            replicator._check_headers({q: torch.tensor(h, dtype=torch.int64)
                                       for q, h in headers.items()})
        replicator._check_headers({1: torch.tensor([1, 50, 10]), 2: torch.tensor([1, 50, 1])})
    finally:
        replicator.close()
