"""Regenerate ``_descriptor.py`` from ``rpc.proto`` (needs grpcio-tools, a dev dependency).

Run ``python -m asynclock.backends.etcd._gen``; ``--check`` exits non-zero if the committed
file is stale (the test suite runs it). Only the serialized ``FileDescriptorSet`` is
committed, not protoc's Python gencode: gencode pins the protobuf runtime to protoc's own
version (a 7.x protoc makes gencode that refuses protobuf 6), while a descriptor loaded
into a private pool works on every protobuf the extra allows and never collides with
another etcd client's generated ``etcdserverpb`` classes in the same process.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
PROTO = HERE / "rpc.proto"
OUT = HERE / "_descriptor.py"

HEADER = '''"""Made from rpc.proto by ``python -m asynclock.backends.etcd._gen``; do not edit."""

import base64

# The serialized FileDescriptorSet of rpc.proto (protoc --descriptor_set_out), base64.
'''


def render() -> str:
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rpc.desc"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{HERE}",
                f"--descriptor_set_out={out}",
                PROTO.name,
            ],
            check=True,
        )
        data = out.read_bytes()
    # Normalise: keep only the file itself, no source info (stable across protoc builds).
    fds = descriptor_pb2.FileDescriptorSet.FromString(data)
    for f in fds.file:
        f.ClearField("source_code_info")
    blob = fds.SerializeToString(deterministic=True)
    text = base64.b64encode(blob).decode()
    body = "".join(f'    "{text[i : i + 88]}"\n' for i in range(0, len(text), 88))
    return f"{HEADER}DESCRIPTOR_SET = base64.b64decode(\n{body})\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python -m asynclock.backends.etcd._gen", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
