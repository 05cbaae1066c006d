"""The tests' reader of pprof profiles: protobuf's own parser, over message
classes built from profile.proto's definitions (google/pprof,
proto/profile.proto, package perftools.profiles) written out below. The
project's encoder (exporters/pprof.py) writes the wire format by hand;
this is the independent reading of it."""

from __future__ import annotations

import gzip
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

# message -> [(field, number, type, repeated, message type)], as profile.proto has them
_I64, _U64, _BOOL, _STR, _MSG = "int64", "uint64", "bool", "string", "message"
PROFILE_PROTO: dict[str, list[tuple[str, int, str, bool, str]]] = {
    "Profile": [
        ("sample_type", 1, _MSG, True, "ValueType"), ("sample", 2, _MSG, True, "Sample"),
        ("mapping", 3, _MSG, True, "Mapping"), ("location", 4, _MSG, True, "Location"),
        ("function", 5, _MSG, True, "Function"), ("string_table", 6, _STR, True, ""),
        ("drop_frames", 7, _I64, False, ""), ("keep_frames", 8, _I64, False, ""),
        ("time_nanos", 9, _I64, False, ""), ("duration_nanos", 10, _I64, False, ""),
        ("period_type", 11, _MSG, False, "ValueType"), ("period", 12, _I64, False, ""),
        ("comment", 13, _I64, True, ""), ("default_sample_type", 14, _I64, False, ""),
    ],
    "ValueType": [("type", 1, _I64, False, ""), ("unit", 2, _I64, False, "")],
    "Sample": [("location_id", 1, _U64, True, ""), ("value", 2, _I64, True, ""),
               ("label", 3, _MSG, True, "Label")],
    "Label": [("key", 1, _I64, False, ""), ("str", 2, _I64, False, ""),
              ("num", 3, _I64, False, ""), ("num_unit", 4, _I64, False, "")],
    "Mapping": [("id", 1, _U64, False, ""), ("memory_start", 2, _U64, False, ""),
                ("memory_limit", 3, _U64, False, ""), ("file_offset", 4, _U64, False, ""),
                ("filename", 5, _I64, False, ""), ("build_id", 6, _I64, False, ""),
                ("has_functions", 7, _BOOL, False, ""), ("has_filenames", 8, _BOOL, False, ""),
                ("has_line_numbers", 9, _BOOL, False, ""),
                ("has_inline_frames", 10, _BOOL, False, "")],
    "Location": [("id", 1, _U64, False, ""), ("mapping_id", 2, _U64, False, ""),
                 ("address", 3, _U64, False, ""), ("line", 4, _MSG, True, "Line"),
                 ("is_folded", 5, _BOOL, False, "")],
    "Line": [("function_id", 1, _U64, False, ""), ("line", 2, _I64, False, "")],
    "Function": [("id", 1, _U64, False, ""), ("name", 2, _I64, False, ""),
                 ("system_name", 3, _I64, False, ""), ("filename", 4, _I64, False, ""),
                 ("start_line", 5, _I64, False, "")],
}  # fmt: skip
_PACKAGE = "perftools.profiles"
_CLASSES: dict[str, Any] = {}


def message_class(name: str) -> Any:
    """The class of one profile.proto message, built once."""
    if not _CLASSES:
        types = descriptor_pb2.FieldDescriptorProto
        kinds = {_I64: types.TYPE_INT64, _U64: types.TYPE_UINT64, _BOOL: types.TYPE_BOOL,
                 _STR: types.TYPE_STRING, _MSG: types.TYPE_MESSAGE}  # fmt: skip
        file = descriptor_pb2.FileDescriptorProto(name="profile.proto", package=_PACKAGE,
                                                  syntax="proto3")  # fmt: skip
        for message, fields in PROFILE_PROTO.items():
            proto = file.message_type.add(name=message)
            for field, number, kind, repeated, of in fields:
                entry = proto.field.add(name=field, number=number, type=kinds[kind])
                entry.label = types.LABEL_REPEATED if repeated else types.LABEL_OPTIONAL
                if of:
                    entry.type_name = f".{_PACKAGE}.{of}"
        pool = descriptor_pool.DescriptorPool()
        pool.Add(file)
        for message in PROFILE_PROTO:
            found = pool.FindMessageTypeByName(f"{_PACKAGE}.{message}")
            _CLASSES[message] = message_factory.GetMessageClass(found)
    return _CLASSES[name]


def parsed(body: bytes) -> Any:
    """A gzipped profile (a file's, serve's answer), read by protobuf."""
    return message_class("Profile").FromString(gzip.decompress(body))
