"""Reads TensorBoard event files with tensorboardX's own protos and CRC-32C (an implementation
independent of dta's C++ writer): every record's framing and checksums are checked."""
from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path: Path) -> list[event_pb2.Event]:
    data = path.read_bytes()
    events, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        assert length_crc == _masked(crc32c(data[at:at + 8])), f"{path}: bad length CRC at {at}"
        payload = data[at + 12:at + 12 + length]
        (payload_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert payload_crc == _masked(crc32c(payload)), f"{path}: bad record CRC at {at}"
        event = event_pb2.Event()
        event.ParseFromString(payload)
        events.append(event)
        at += 16 + length
    return events


def read_scalars(directory: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} over every event file in `directory`; the first event of each file must
    name the file version."""
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}"
    scalars: dict[int, dict[str, float]] = {}
    for path in files:
        events = read_events(path)
        assert events and events[0].file_version == "brain.Event:2", path
        for event in events[1:]:
            scalars.setdefault(event.step, {}).update(
                {value.tag: value.simple_value for value in event.summary.value})
    return scalars
