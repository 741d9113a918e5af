"""Request bytes -> ssd.v1 messages, with errors that name the field.

protobuf refuses a string field that is not valid UTF-8 with a bare
DecodeError, which grpc turns into INTERNAL "Exception deserializing request!"
and a server traceback. The server therefore receives raw bytes and parses
them here; on failure it parses again with a lenient twin of the message
(every string field read as bytes) to find which field is at fault.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from ssd.serve.validation import InvalidArgument

_LENIENT = "lenient."  # package prefix of the twins, so they never clash with the real types


def parse(message_cls: Any, raw: bytes) -> Any:
    """The message, or InvalidArgument naming the first string field that is not UTF-8."""
    try:
        return message_cls.FromString(raw)
    except DecodeError as exc:
        try:
            twin = _lenient_class(message_cls.DESCRIPTOR.full_name, message_cls.DESCRIPTOR.file).FromString(raw)
        except DecodeError:
            raise InvalidArgument("request", f"not a valid {message_cls.DESCRIPTOR.name}: {exc}") from None
        field = _first_non_utf8(twin)
        raise InvalidArgument(field or "request", "not valid UTF-8" if field else str(exc)) from None


@functools.cache
def _lenient_class(full_name: str, file: Any) -> Any:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    old_package = proto.package
    proto.name = _LENIENT + proto.name
    proto.package = _LENIENT + old_package
    proto.ClearField("service")  # services are not needed to parse, and name the real types
    for message in proto.message_type:
        _strings_as_bytes(message, old_package)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(_LENIENT + full_name))


def _strings_as_bytes(message: descriptor_pb2.DescriptorProto, old_package: str) -> None:
    map_entry = message.options.map_entry  # map keys must stay strings (logit_bias's are numbers)
    for field in message.field:
        if field.type == FieldDescriptor.TYPE_STRING and not map_entry:
            field.type = FieldDescriptor.TYPE_BYTES
        if field.type_name.startswith(f".{old_package}."):
            field.type_name = f".{_LENIENT}{field.type_name[1:]}"
    for nested in message.nested_type:
        _strings_as_bytes(nested, old_package)


def _first_non_utf8(message: Any, prefix: str = "") -> str | None:
    """The path of the first bytes value that does not decode, e.g. "stop[1]" or "chat.messages[0].content"."""
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # a map of numbers (logit_bias): no strings in it
        path = f"{prefix}{field.name}"
        values = list(value) if field.is_repeated else [value]
        for i, item in enumerate(values):
            where = f"{path}[{i}]" if field.is_repeated else path
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _first_non_utf8(item, f"{where}.")
                if found:
                    return found
            elif field.type == FieldDescriptor.TYPE_BYTES:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return where
    return None
