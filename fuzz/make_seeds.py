#!/usr/bin/env python3
"""Writes the binary seeds of the wire-format fuzz targets into fuzz/seeds/ (checked in; rerun
after a wire change): tcp frames (transfer/tcp/frame.h), engine control messages (the golden
bytes of tests/transfer_control_wire_test.cpp) and testbed messages as CBOR (the wire forms of
tests/testbed_protocol_test.cpp). Plain Python, no packages: a minimal CBOR encoder below.

    python3 fuzz/make_seeds.py
"""

import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent / "seeds"


def write(target, name, data):
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


# ---- tcp frames ----
MAGIC, VERSION = 0x46534450, 1
HELLO, ACK, REJECT, DATA, BYE, ERROR = 1, 2, 3, 4, 5, 6


def frame(ftype, tag, payload=b"", flags=0):
    return struct.pack("<IHHIIQ", MAGIC, VERSION, ftype, tag, flags, len(payload)) + payload


def hello(world, token):
    return struct.pack("<II", world, len(token)) + token


frames = {
    "hello": frame(HELLO, 1, hello(2, b"0123456789abcdef")),
    "hello_ack": frame(ACK, 0, struct.pack("<I", 2)),
    "reject": frame(REJECT, 0, b"wrong session token"),
    "data": frame(DATA, 17, bytes(range(64))),
    "bye": frame(BYE, 0),
    "error": frame(ERROR, 0, b"protocol error"),
    "flags": frame(DATA, 3, b"x", flags=7),
}
frames["session"] = b"".join(frames[k] for k in ("hello", "hello_ack", "data", "data", "bye"))
for name, data in frames.items():
    write("tcp_frame_fuzz", name, data)

# ---- engine control messages (tests/transfer_control_wire_test.cpp's golden bytes) ----
control = {
    "bootstrap": "50444b5602000100887766554433221105000000010000000200000019000000e803000000000000"
                 "00001000000000000003000000020000001000000002000000020000000100000008000000040000"
                 "0004000000000100000000000008070605040302010300000007000000ffffffff2c010000250000"
                 "00",
    "ack": "50444b56020002002a000000000000000300000004000000000f0000006c61796f7574206d69736d"
           "61746368000001000000000001030000000100000010000000020000000200000001000000080000"
           "0004000000040000000001000000000000080706050403020101",
    "chunk": "50444b56020003004d00000000000000020000000002000000000000000300000000000001200000"
             "00000000000300000028000000290000002a000000",
    "abort": "50444b56020004000900000000000000100000007065657220332074696d6564206f7574",
    "heartbeat": "50444b56020005000000000000000000",
    "completion": "50444b560200060015cd5b07000000000100000001ff7c0000020000000200000004000000010000"
                  "00030000000104000000010000000000000002000000000000000df0fecaefbeadde040000000000"
                  "0000",
    "regions": "50444b56020007000807060504030201060000000200000002000000040000000100000002000000"
               "000000000300000006000000a1b1b2d1d2d30300000002000000e1e2",
    "layer_written": "50444b56020008001f0000000000000003000000040302013d000000e8030000"
                     "5544332211000000",
    "quiesced": "50444b56020009002c0000000000000001000000180000006465636f64652072616e6b2032206162"
                "6f72746564206974",
    "data_posted": "50444b5602000a002d0000000000000002000000030000000400000006000000"
                   "0200000000010000000000000020000000000000",
}
for name, h in control.items():
    write("control_codec_fuzz", name, bytes.fromhex(h))


# ---- testbed messages as CBOR ----
def cbor_head(major, n):
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(v):
    if v is None:
        return b"\xf6"
    if v is True:
        return b"\xf5"
    if v is False:
        return b"\xf4"
    if isinstance(v, int):
        return cbor_head(0, v) if v >= 0 else cbor_head(1, -1 - v)
    if isinstance(v, float):
        return b"\xfb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return cbor_head(3, len(b)) + b
    if isinstance(v, list):
        return cbor_head(4, len(v)) + b"".join(cbor(x) for x in v)
    if isinstance(v, dict):
        return cbor_head(5, len(v)) + b"".join(cbor(k) + cbor(x) for k, x in v.items())
    raise TypeError(v)


entry = {"id": 4, "t0": 0, "t1": 3, "tok": [5, 6, 7], "pg": [9], "f": True, "l": False, "n": 20}
messages = {
    "submit": {"k": "submit", "id": 7, "in": 1200, "out": 33, "hash": [11, -2, 40000000000],
               "p": 1, "d": 3},
    "cancel": {"k": "cancel", "id": 12},
    "end": {"k": "end"},
    "step": {"k": "step", "m": "d", "e": [entry, dict(entry, id=5, t0=19, t1=20)]},
    "admit": {"k": "admit", "id": 3, "pg": [4, 5], "n": 17, "pr": [0, 1]},
    "release": {"k": "release", "id": 99},
    "fsent": {"k": "fsent", "id": 2, "ok": True, "err": "", "tok": -1, "bytes": 0,
              "idle": True},
    "fready": {"k": "fready", "id": 8, "ok": False, "err": "busy", "tok": 41, "bytes": 1 << 40,
               "idle": False},
    "fidle": {"k": "fidle", "id": 8},
    "first": {"k": "first", "ph": "disagg", "id": 1, "t": 12.5, "ps": 3.25},
    "pdone": {"k": "pdone", "ph": "disagg", "id": 2, "ok": False, "err": "send failed",
              "t": 100.0, "ps": -1.0},
    "done": {"k": "done", "ph": "colocated", "id": 3, "ok": True, "err": "", "t": 50.0,
             "tokens": [1, 2], "tt": [40.0, 50.0], "bytes": 4096},
    "tcp": {"k": "tcp", "dir": "/tmp/pdsim-tcp-abc", "tok": "00ff"},
    "shape": {"k": "shape", "ts": 0.125},
    "exit": {"k": "exit", "code": 2, "msg": "bad flag"},
    "result": {"k": "result", "rank": 3, "phase": "disagg", "timeline": [], "xfer": [],
               "pend": {}, "ordering": {"checked": 0, "violations": []}, "stats": {},
               "error": ""},
}
for name, m in messages.items():
    write("testbed_protocol_fuzz", name, cbor(m))
