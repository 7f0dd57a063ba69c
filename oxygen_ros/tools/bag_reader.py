"""Open a rosbag2 for reading, including an MCAP recording that was never closed (a killed recorder).

A finished rosbag2 (``metadata.yaml`` and complete storage files) is read with ``rosbags``' ``AnyReader``, in
time order. A recorder killed by SIGKILL, the OOM killer or a power loss leaves no ``metadata.yaml`` and an
MCAP file without its summary and footer, which ``AnyReader`` cannot open; :class:`UnfinishedMcapReader` reads
such a file front to back with the ``mcap`` library's streaming reader and keeps every record that is
complete on disk (for this project's recorder: every chunk flushed before the crash, see
``bag_recorder.BagWriter``). An sqlite3 bag without ``metadata.yaml`` is not recovered.

API:
    * :func:`open_bag` — the right reader for a path, opened.
    * :class:`UnfinishedMcapReader` — the recovery reader; its :attr:`~UnfinishedMcapReader.recovery` says
      what it recovered.
    * :class:`BagError` — a path that is not a readable bag.

Both readers offer what the player uses: ``connections`` (each with ``id``, ``topic``, ``msgtype``),
``start_time`` and ``duration`` [ns], ``messages(connections=...)`` yielding ``(connection, log time [ns],
serialized CDR)``, ``typestore`` (the message definitions the bag was recorded with, where it stores them) and
``close()``.

Old recordings: :class:`Upgrade` re-encodes a message of this package recorded with an earlier definition of
its type (a field added since, e.g. ``ActionChunk``'s ``rtc_*``) into the installed definition, the added
fields at their documented "not set" value (:data:`ADDED_FIELD_DEFAULTS`, otherwise zero / empty).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator, NamedTuple

import numpy as np

from mcap.exceptions import EndOfFile, McapError
from mcap.records import Channel, Chunk, Footer, Message, Schema
from mcap.stream_reader import StreamReader, breakup_chunk
from mcap.writer import MCAP0_MAGIC
from rosbags.highlevel import AnyReader, AnyReaderError
from rosbags.typesys import get_types_from_msg
from rosbags.typesys.store import Nodetype, Typestore


class BagError(Exception):
    """A path that is not a readable rosbag2; the message says why in one line."""


class RecoveredConnection(NamedTuple):
    """One topic of an unfinished MCAP (``id`` is this reader's own numbering, from 1)."""

    id: int
    topic: str
    msgtype: str


@dataclass(frozen=True)
class Recovery:
    """What :class:`UnfinishedMcapReader` found.

    Attributes:
        files: the MCAP files read, in order.
        messages: complete messages recovered.
        start_time: first message's log time [ns] (0 without messages).
        end_time: last message's log time [ns] (0 without messages).
        skipped_bytes: bytes at the files' ends that were not a complete record (the part of the recording
            that was never flushed whole) [bytes].
        finished: every file ended with its MCAP footer (nothing was cut off).
    """

    files: tuple[Path, ...]
    messages: int
    start_time: int
    end_time: int
    skipped_bytes: int
    finished: bool

    def describe(self) -> str:
        """One line for the user: what was recovered and what was lost."""
        names = ", ".join(f.name for f in self.files)
        span_s = (self.end_time - self.start_time) * 1e-9
        text = f"recovered {self.messages} messages ({span_s:.2f} s) from the unfinished recording {names}"
        if not self.finished:
            text += (f"; the last {self.skipped_bytes} bytes, after its last complete chunk, were skipped (what "
                     "the recorder had not flushed whole when it stopped)")
        return text


def _complete_records(stream: IO[bytes]) -> Iterator[tuple[object, int]]:
    """``(record, end offset [bytes])`` of each MCAP record of ``stream`` known to be complete on disk.

    A record counts as complete once the reader has gone past it (read the next record's header) or it is
    the footer: the streaming reader returns a short read at the end of a cut file as if it were data, so
    the last record of a file without footer is never trusted. Chunks are returned whole (not broken up).

    Raises:
        mcap.exceptions.InvalidMagic: the stream does not start with the MCAP magic.
    """
    pending: tuple[object, int] | None = None
    try:
        for record in StreamReader(stream, emit_chunks=True).records:
            if pending is not None:
                yield pending
            pending = (record, stream.tell())
            if isinstance(record, Footer):
                yield pending
                return
    except (EndOfFile, struct.error, UnicodeDecodeError):
        return  # the file ends inside a record: pending (maybe cut too) is dropped


@dataclass
class _Extent:
    """How far the complete records of one file reach: ``end`` [bytes], and whether the footer was read."""

    end: int = 0
    finished: bool = False


# The "not set" value of fields added to this package's messages, for messages recorded before they existed
# (each field's comment in msg/ says what the value means); other added fields get zero / empty / false.
ADDED_FIELD_DEFAULTS: dict[str, dict[str, object]] = {
    "oxygen_ros/msg/ActionChunk": {"rtc_delay_steps": -1, "rtc_takeover_index": -1},
}


class Upgrade:
    """Re-encodes CDR messages of ``msgtype`` recorded with the definition in ``recorded`` into the one in
    ``installed``: fields of both keep their values, fields only the installed definition has get
    :data:`ADDED_FIELD_DEFAULTS` or zero / empty / false (nested messages field by field), fields it no longer
    has are dropped.

    Raises:
        ValueError: a field of both whose type changed (the recording cannot be read as the installed type).
    """

    def __init__(self, msgtype: str, recorded: Typestore, installed: Typestore):
        self.msgtype, self._recorded, self._installed = msgtype, recorded, installed
        old = dict(recorded.fielddefs[msgtype][1])
        new = dict(installed.fielddefs[msgtype][1])
        changed = [name for name in old.keys() & new.keys() if old[name] != new[name]]
        if changed:
            raise ValueError(f"{msgtype}: recorded with another type of field(s) {sorted(changed)}")
        self.added = [name for name in new if name not in old]
        self.dropped = [name for name in old if name not in new]

    @staticmethod
    def needed(msgtype: str, recorded: Typestore | None, installed: Typestore) -> bool:
        """True when ``recorded`` defines ``msgtype`` with other fields than ``installed`` (None: unknown, False)."""
        if recorded is None or msgtype not in recorded.fielddefs or msgtype not in installed.fielddefs:
            return False
        return recorded.fielddefs[msgtype][1] != installed.fielddefs[msgtype][1]

    def __call__(self, raw: bytes) -> bytes:
        """The installed type's CDR of the recorded message ``raw``."""
        old = self._recorded.deserialize_cdr(bytes(raw), self.msgtype)
        defaults = ADDED_FIELD_DEFAULTS.get(self.msgtype, {})
        fields = {}
        for name, definition in self._installed.fielddefs[self.msgtype][1]:
            if name in self.added:
                fields[name] = defaults[name] if name in defaults else self._zero(definition)
            else:
                fields[name] = getattr(old, name)
        message = self._installed.types[self.msgtype](**fields)
        return bytes(self._installed.serialize_cdr(message, self.msgtype))

    def _zero(self, definition):
        kind, detail = definition
        if kind == Nodetype.BASE:
            return {"string": "", "bool": False, "float32": 0.0, "float64": 0.0}.get(detail[0], 0)
        if kind == Nodetype.NAME:
            return self._installed.types[detail](**{n: self._zero(d) for n, d in self._installed.fielddefs[detail][1]})
        element, length = detail
        numeric = element[0] == Nodetype.BASE and element[1][0] not in ("string", "bool")
        if kind == Nodetype.SEQUENCE:
            return np.zeros(0, dtype=np.dtype(element[1][0])) if numeric else []
        return np.zeros(length, dtype=np.dtype(element[1][0])) if numeric else [self._zero(element)] * length


def _schema_types(schema: Schema) -> dict:
    """The rosbags type definitions of one MCAP ``ros2msg`` schema (the type's text, then each nested type's
    after a line of ``=`` and ``MSG: <type>``); empty for other encodings or text rosbags cannot parse."""
    if schema.encoding != "ros2msg":
        return {}
    sections = [part for part in schema.data.decode("utf-8", "replace").split("\n" + "=" * 80 + "\n")]
    types = {}
    try:
        types.update(get_types_from_msg(sections[0], schema.name))
        for section in sections[1:]:
            header, _, text = section.partition("\n")
            if header.startswith("MSG: "):
                name = header[5:].strip()
                name = name if "/msg/" in name else name.replace("/", "/msg/", 1)
                types.update(get_types_from_msg(text, name))
    except Exception:  # noqa: BLE001  rosbags' parser raises its own error types on text it cannot read
        return {}
    return types


class UnfinishedMcapReader:
    """Reads the complete records of MCAP files whose recorder never closed them (no summary or footer).

    Messages come in file order (the order they were recorded), not sorted by time. Opening reads each file
    once to find its topics, message count and time span; each :meth:`messages` call reads them again.

    Args:
        files: the ``.mcap`` files of one recording, in order.

    Raises:
        BagError: a file is not MCAP, or a message names a channel the file never defines.
    """

    def __init__(self, files: Iterable[Path]):
        self.files = tuple(Path(f) for f in files)
        self._ids: dict[tuple[str, str], RecoveredConnection] = {}
        self._types: dict = {}
        count, start, end, skipped, finished = 0, 2**63 - 1, 0, 0, True
        for path in self.files:
            extent = _Extent()
            for _, message in self._file_messages(path, extent):
                count += 1
                start, end = min(start, message.log_time), max(end, message.log_time)
            if not extent.finished:
                finished = False
                skipped += path.stat().st_size - extent.end
        self.connections: list[RecoveredConnection] = list(self._ids.values())
        self.typestore: Typestore | None = None
        if self._types:
            from rosbags.typesys import Stores, get_typestore

            self.typestore = get_typestore(Stores.EMPTY)
            self.typestore.register(self._types)
        self.recovery = Recovery(self.files, count, start if count else 0, end, skipped, finished)

    @property
    def start_time(self) -> int:
        """First message's log time [ns]."""
        return self.recovery.start_time

    @property
    def duration(self) -> int:
        """Last minus first message's log time [ns]."""
        return self.recovery.end_time - self.recovery.start_time

    def messages(self, connections: Iterable[RecoveredConnection] | None = None
                 ) -> Iterator[tuple[RecoveredConnection, int, bytes]]:
        """``(connection, log time [ns], serialized CDR)`` of every recovered message of ``connections``
        (all when None), in file order."""
        wanted = None if connections is None else {c.id for c in connections}
        for path in self.files:
            for connection, message in self._file_messages(path, _Extent()):
                if wanted is None or connection.id in wanted:
                    yield connection, message.log_time, message.data

    def close(self) -> None:
        """Nothing stays open between reads; here for the reader interface."""

    def _file_messages(self, path: Path, extent: _Extent) -> Iterator[tuple[RecoveredConnection, Message]]:
        """The complete messages of ``path`` with their connection; ``extent`` follows the reading."""
        schemas: dict[int, Schema] = {}
        channels: dict[int, RecoveredConnection] = {}
        if path.stat().st_size < len(MCAP0_MAGIC):
            return  # cut before the end of its magic: nothing recorded
        with path.open("rb") as stream:
            try:
                for record, extent.end in _complete_records(stream):
                    if isinstance(record, Footer):
                        extent.finished = True
                        return
                    for item in breakup_chunk(record) if isinstance(record, Chunk) else [record]:
                        if isinstance(item, Schema):
                            schemas[item.id] = item
                            if item.name not in self._types:
                                self._types.update(_schema_types(item))
                        elif isinstance(item, Channel):
                            channels[item.id] = self._connection(item, schemas)
                        elif isinstance(item, Message):
                            if item.channel_id not in channels:
                                raise BagError(f"{path}: a message of channel {item.channel_id}, which the "
                                               "file never defines")
                            yield channels[item.channel_id], item
            except McapError as err:
                raise BagError(f"{path}: {err}") from None

    def _connection(self, channel: Channel, schemas: dict[int, Schema]) -> RecoveredConnection:
        msgtype = schemas[channel.schema_id].name if channel.schema_id in schemas else ""
        key = (channel.topic, msgtype)
        if key not in self._ids:
            self._ids[key] = RecoveredConnection(len(self._ids) + 1, channel.topic, msgtype)
        return self._ids[key]


def open_bag(path: Path | str, typestore: Typestore):
    """Open the recording at ``path`` for reading.

    Args:
        path: a rosbag2 directory (MCAP or sqlite3), or one ``.mcap`` file.
        typestore: message definitions for ``AnyReader`` where the bag lacks them.

    Returns:
        An opened ``rosbags.highlevel.AnyReader`` for a finished rosbag2; an :class:`UnfinishedMcapReader` for
        a single ``.mcap`` file or a directory of ``.mcap`` files without ``metadata.yaml`` or that
        ``AnyReader`` cannot read (a recorder that never closed the bag).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        BagError: ``path`` is not a bag this can read (the message says why).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        if path.suffix != ".mcap":
            raise BagError(f"{path} is not a rosbag2 directory or an .mcap file")
        return UnfinishedMcapReader([path])
    mcaps = sorted(path.glob("*.mcap"))
    if (path / "metadata.yaml").is_file():
        reader = AnyReader([path], default_typestore=typestore)
        try:
            reader.open()
            return reader
        except AnyReaderError as err:
            if not mcaps:
                raise BagError(f"{path}: {err}") from None
    elif any(path.glob("*.db3")) and not mcaps:
        raise BagError(f"{path} has no metadata.yaml: an sqlite3 bag its recorder never closed, which cannot be "
                       "recovered here")
    elif not mcaps:
        raise BagError(f"{path} is not a rosbag2: no metadata.yaml and no .mcap file")
    return UnfinishedMcapReader(mcaps)
