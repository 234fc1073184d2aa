"""Safetensors helpers for the CLI shell tests (Python standard library only).

Usage from the shell:
  python3 st_util.py shapes FILE                       -> "name dtype d0,d1" per tensor
  python3 st_util.py check-run-output FILE T H K E     -> exit 1 unless the 4 outputs match
  python3 st_util.py write-f32 FILE NAME ROWS COLS     -> a valid file with one f32 tensor
  python3 st_util.py corrupt MODE SRC DST [TENSOR]     -> a damaged copy of SRC (see MODES)
"""
import json
import math
import random
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return header, raw[8 + n:]


def write(path, header, data, header_len=None):
    text = json.dumps(header).encode()
    if header_len is not None:
        text = text.ljust(header_len, b" ")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_len if header_len is not None else len(text)))
        f.write(text)
        f.write(data)


def tensors(header):
    return {k: v for k, v in header.items() if k != "__metadata__"}


def pick(header, pattern):
    names = sorted(k for k in tensors(header) if pattern in k)
    if not names:
        sys.exit("no tensor matching %r" % pattern)
    return names[0]


def main():
    cmd = sys.argv[1]
    if cmd == "shapes":
        header, _ = read(sys.argv[2])
        for name, t in sorted(tensors(header).items()):
            print(name, t["dtype"], ",".join(str(d) for d in t["shape"]))
    elif cmd == "check-run-output":
        path, T, H, K, E = sys.argv[2], *map(int, sys.argv[3:7])
        header, data = read(path)
        want = {"output": ("F32", [T, H]), "topk_ids": ("I32", [T, K]),
                "topk_weights": ("F32", [T, K]), "router_logits": ("F32", [T, E])}
        got = {k: (v["dtype"], v["shape"]) for k, v in tensors(header).items()}
        if got != want:
            sys.exit("%s: expected tensors %s, got %s" % (path, want, got))
        b, e = header["output"]["data_offsets"]
        out = struct.unpack("<%df" % (T * H), data[b:e])
        if not all(math.isfinite(v) for v in out):
            sys.exit("%s: output has NaN/Inf" % path)
        b, e = header["topk_ids"]["data_offsets"]
        ids = struct.unpack("<%di" % (T * K), data[b:e])
        if not all(-1 <= i < E for i in ids):
            sys.exit("%s: topk_ids out of range" % path)
    elif cmd == "write-f32":
        path, name, rows, cols = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        rng = random.Random()
        data = struct.pack("<%df" % (rows * cols), *[rng.gauss(0, 1) for _ in range(rows * cols)])
        write(path, {name: {"dtype": "F32", "shape": [rows, cols],
                            "data_offsets": [0, len(data)]}}, data)
    elif cmd == "npy":
        # npy PATH FMT ROWS COLS FILL [R,C=VALUE ...]: a .npy file (format 1.0,
        # C order) of struct format FMT (f: f32, d: f64, e: f16), every element
        # FILL but the ones set; no numpy needed.
        path, fmt, rows, cols, fill = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
        values = [fill] * (rows * cols)
        for spec in sys.argv[7:]:
            where, value = spec.split("=")
            r, c = map(int, where.split(","))
            values[r * cols + c] = float(value)
        descr = {"f": "<f4", "d": "<f8", "e": "<f2"}[fmt]
        head = "{'descr': '%s', 'fortran_order': False, 'shape': (%d, %d), }" % (descr, rows, cols)
        head += " " * (63 - (10 + len(head)) % 64) + "\n"  # 10 + len(head) a multiple of 64
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode("latin1"))
            f.write(struct.pack("<%d%s" % (rows * cols, fmt), *values))
    elif cmd == "corrupt":
        mode, src, dst = sys.argv[2:5]
        pattern = sys.argv[5] if len(sys.argv) > 5 else "experts.3."
        with open(src, "rb") as f:
            raw = f.read()
        header, data = read(src)
        chosen = ""
        if mode == "truncate":  # cut the file in the middle of the data section
            with open(dst, "wb") as f:
                f.write(raw[:len(raw) - len(data) // 2])
        elif mode == "header-past-eof":  # header length larger than the file
            with open(dst, "wb") as f:
                f.write(struct.pack("<Q", len(raw) * 4) + raw[8:])
        elif mode == "offsets-outside":  # one tensor's data_offsets beyond the data section
            name = chosen = pick(header, pattern)
            b, e = header[name]["data_offsets"]
            header[name]["data_offsets"] = [len(data) + 64, len(data) + 64 + (e - b)]
            write(dst, header, data)
        elif mode == "transpose-shape":  # same bytes, expert weight transposed
            name = chosen = pick(header, pattern)
            header[name]["shape"] = list(reversed(header[name]["shape"]))
            write(dst, header, data)
        elif mode == "dtype-f32":  # same bytes, read as f32 with half the rows
            name = chosen = pick(header, pattern)
            shape = header[name]["shape"]
            assert header[name]["dtype"] == "BF16" and shape[0] % 2 == 0
            header[name]["dtype"] = "F32"
            header[name]["shape"] = [shape[0] // 2] + shape[1:]
            write(dst, header, data)
        elif mode == "rename":  # the tensor disappears under its expected name
            name = chosen = pick(header, pattern)
            header[name + ".renamed"] = header.pop(name)
            write(dst, header, data)
        elif mode == "nan-weight":  # one element of an expert weight becomes NaN
            name = chosen = pick(header, pattern)
            assert header[name]["dtype"] == "BF16"
            b, _ = header[name]["data_offsets"]
            data = bytearray(data)
            data[b + 6:b + 8] = struct.pack("<H", 0x7FC0)  # element [0, 3]
            write(dst, header, bytes(data))
        elif mode == "negate":  # every element's sign flipped (same shapes, other weights)
            name = chosen = pick(header, pattern)
            width = {"BF16": 2, "F16": 2, "F32": 4}[header[name]["dtype"]]
            b, e = header[name]["data_offsets"]
            data = bytearray(data)
            for i in range(b + width - 1, e, width):
                data[i] ^= 0x80
            write(dst, header, bytes(data))
        elif mode == "bad-json":
            n = struct.unpack("<Q", raw[:8])[0]
            with open(dst, "wb") as f:
                f.write(raw[:8] + b"{" * n + raw[8 + n:])
        else:
            sys.exit("unknown mode " + mode)
        print(chosen)
    else:
        sys.exit("unknown command " + cmd)


if __name__ == "__main__":
    main()
